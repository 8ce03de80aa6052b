"""RULER-style long-context tasks (https://arxiv.org/abs/2404.06654), generated offline.

Every sample is generated from a seed and a haystack text (WikiText-2 by default, or any text the
user points at) at a token length measured with the model's own tokenizer, in the model's prompt
format (its chat template for instruct models, plain continuation for base models), and scored as
RULER scores it (string-match recall of each needle or word).

Modules: ``haystack`` (the text, its sentences and words), ``prompts`` (model format, fitting a
prompt to a token budget), ``families`` (what each task family generates), ``scoring``
(RULER's string match), ``shared`` (one prefill for every compared system, then each system's
greedy decode), ``evaluate`` (the runner's ``ruler`` task), ``cost`` (the ``ruler_cost`` task)
and ``report`` (tables, targets and figures).
"""
