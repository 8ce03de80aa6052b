"""RULER-style long-context tasks (https://arxiv.org/abs/2404.06654), generated offline.

Modules: ``families`` (the haystack, each family's prompts fitted to a token length, RULER's
string-match scoring), ``options`` (``[options.ruler]``), ``shared`` (the runner's ``ruler`` and
``ruler_cost`` tasks: one prefill for every compared system, then each system's greedy decode),
``report`` (tables, targets and figures) and ``pool`` (runs of different seeds as one report).
"""
