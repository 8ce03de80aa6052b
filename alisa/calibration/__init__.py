"""Measuring this machine for the scheduler from the model's own work: timed decode steps
(:mod:`.steps`: resident, tiered and host-retention steps) and the whole profile with its
fallbacks and spreads (:mod:`.profile`, what ``alisa profile`` runs). The fits are
:mod:`scheduler.calibrate` (no torch); :mod:`alisa.planning` reads the profile.
"""
