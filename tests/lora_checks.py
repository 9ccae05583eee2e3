"""How far an engine's sampled logprobs are from a PEFT policy's, and from its base model's."""

from __future__ import annotations


def logprob_gaps(policy, rows) -> tuple[float, float]:
    """Largest |engine logprob - the PEFT policy's| and |engine logprob - its base model's| over
    ``rows`` of (prompt ids, Completion): an engine serving the adapter has the first near 0 and
    the second well above it."""
    import torch

    from learner.packing import packed_completion_logprobs

    prompts, completions = [p for p, _ in rows], [c.token_ids for _, c in rows]
    with torch.no_grad():
        adapted = packed_completion_logprobs(policy, prompts, completions)
        with policy.disable_adapter():
            base = packed_completion_logprobs(policy, prompts, completions)

    def largest(reference) -> float:
        return float(torch.cat([(torch.tensor(c.logprobs) - r).abs() for (_, c), r in zip(rows, reference)]).max())

    return largest(adapted), largest(base)
