"""The KV cache: which tokens a layer holds, where, and the attention over them.

``AlisaCache`` (:mod:`.cache`) is a transformers ``Cache`` of ``AlisaLayer``s (:mod:`.layer`, the
Hugging Face face of one layer). A layer owns a slot map (:mod:`.slots`: which token sits in
which slot), a store (:mod:`alisa.storage`: the bytes) and a keeper (:mod:`.keeper`: which
tokens stay on the device), one of :class:`.drop.DropKeeper` (ALISA's SWA, H2O, ... evict for
good) or :class:`.host.HostKeeper` (every token in host memory, the best fetched per step). Both
choose through :mod:`.selection`; attention sums live in :mod:`.accumulator`. The ``alisa``
attention function (:mod:`.attention`) reaches the layers through :mod:`.hooks`.

Submodules are imported by name (this file imports nothing), so that any of them can be used
without loading the others.
"""
