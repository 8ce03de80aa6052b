"""Planning with the scheduler: the scheduler's view of a model and a config (:mod:`.spec`), this
machine's saved profile (:mod:`.hardware`), and tier sizes at run time (:mod:`.tiers`).

The LP and cost model themselves are :mod:`scheduler` (no torch); the measurements that fill a
profile are :mod:`alisa.calibration`.
"""
