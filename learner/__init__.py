"""The learner service: scored rollouts in, GRPO steps, policy weights and progress out.

``recipe.py`` composes it (the run loop and resume) from ``batching.py`` (complete groups into
batches, safe offsets), ``preparation.py`` (staleness, filters, advantages), ``trainer.py`` (the
optimisation step; ``step_process.py`` runs it in a child process, ``distributed.py`` over ranks),
``publication.py`` (weights and progress) and ``checkpoint.py``. See docs/ARCHITECTURE.md.
"""
