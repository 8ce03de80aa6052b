"""Running a model with the cache: the one decode loop (:mod:`.engine`), token choice
(:mod:`.sampling`) and the ``generate()`` API (:mod:`.generate`)."""
