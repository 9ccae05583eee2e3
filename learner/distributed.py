"""Multi-process training with FSDP2 (``torch.distributed.fsdp.fully_shard``).

``shard`` wraps every decoder layer and then the root, so parameters,
gradients and optimizer state are split across ranks and gathered one layer
at a time. Runs under ``torchrun`` with NCCL on GPUs and with gloo on CPU
(that is how ``tests/integration/test_learner_ranks.py`` checks it: 2 CPU
processes give the same loss and gradient norm as 1 at every step).

``grpo_loss_on_share`` is the learner's loss on a rank's share of a batch
(sequences ``rank::world``), used by ``bench/learner_gpu.py``.

The learner service on several ranks (``conveyor serve learner`` under
``torchrun``) uses ``RankGroup``: rank 0 is the learner (it consumes the
scored topic, builds batches, publishes weights, writes checkpoints) and
sends every collective operation to the other ranks, which follow
(``Trainer.follow``, learner/trainer.py). Commands travel on a gloo group of their own
(objects pickled by ``broadcast_object_list``), so the followers can wait
for the next batch as long as rollouts take to arrive, whatever backend
the training collectives use. State dicts are gathered and loaded with
``torch.distributed.checkpoint.state_dict`` in full (FQN-keyed) form, or each rank's share
of them (``learner.checkpoint_layout: sharded``, learner/sharded_checkpoint.py); either way a
checkpoint written by N ranks resumes on M.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from conveyor.errors import ConfigError
from learner.context_parallel import ContextGroup

# Followers wait on the command group for the next batch: as long as rollouts take to come.
COMMAND_TIMEOUT = timedelta(days=7)


class RankGroup:
    """This process's place in a multi-rank learner, with the command channel from rank 0, and in
    the device mesh of data-parallel groups × context-parallel ranks (``context``: this rank's
    context-parallel group; of one rank without context parallelism)."""

    def __init__(self, rank: int, world: int, commands, context: ContextGroup | None = None) -> None:
        self.rank, self.world, self.commands = rank, world, commands
        self.context = context or ContextGroup(None, 1, 0)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel(self) -> int:
        """The number of data-parallel groups: the ways a batch is divided."""
        return self.world // self.context.size

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel group (its ranks take the same share of a batch)."""
        return self.rank // self.context.size

    @classmethod
    def from_env(cls, context_parallel: int = 1) -> RankGroup | None:
        """Join the process group torchrun describes (``WORLD_SIZE`` > 1), or None for one process.
        NCCL on GPUs (each rank on ``cuda:LOCAL_RANK``), gloo on CPU. ``context_parallel``: ranks
        per context-parallel group (``learner.context_parallel``), which must divide the ranks."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world % context_parallel:
            raise ConfigError(f"learner.context_parallel: {context_parallel} must divide the learner's ranks, {world} "
                              "(torchrun --nproc-per-node)")  # fmt: skip
        if world <= 1:
            return None
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        context = None
        if context_parallel > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cuda" if cuda else "cpu", (world // context_parallel, context_parallel),
                                    mesh_dim_names=("dp", "cp"))  # fmt: skip
            group = mesh.get_group("cp")
            context = ContextGroup(group, context_parallel, dist.get_rank(group))
        return cls(dist.get_rank(), dist.get_world_size(), commands, context)

    def command(self, op: str | None = None, payload=None) -> tuple[str, object]:
        """Rank 0 sends ``(op, payload)``; every rank returns it (the others block until it comes)."""
        box = [(op, payload) if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.commands)
        return box[0]  # type: ignore[return-value]

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.commands)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def split_by_tokens(lengths: list[int], world: int) -> list[list[int]]:
    """Sequence indices per rank, balancing token counts (longest first onto the lightest rank;
    deterministic, so every rank computes the same split). Each list keeps batch order."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model) -> dict:
    """The unsharded state dict, FQN-keyed, on rank 0 (CPU; other ranks get ``{}``). Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=dist.is_initialized()))


def full_optimizer_state(model, optimizer) -> dict:
    """The optimizer's unsharded state, keyed by parameter FQN, on rank 0. Collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=dist.is_initialized()))


def load_full_state(model, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Load full state dicts (given on rank 0; ``{}`` elsewhere) into a sharded or plain model. Collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    spread = dist.is_initialized()
    set_model_state_dict(model, model_state, options=_options(broadcast_from_rank0=spread))
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=_options(broadcast_from_rank0=spread))


def sharded_model_state(model) -> dict:
    """This rank's model state dict, FQN-keyed, its sharded parameters as DTensors (no gather)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))


def sharded_optimizer_state(model, optimizer) -> dict:
    """This rank's optimizer state, keyed by parameter FQN, its moments as DTensors (no gather)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=False))


def load_sharded_state(model, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Load this rank's share (``sharded_*_state``'s form) on every rank. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=False)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def shard(model, *, mixed_precision: bool = False):
    """FSDP2-shard a causal LM for the packed log-prob path; returns the root module to train
    (a ``LogprobHead`` around ``model``: embeddings, final norm and a tied LM head stay in
    the root unit, gathered around its forward)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from learner.packing import LogprobHead

    kwargs = {}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = LogprobHead(model)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    return root


def rank_share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


def grpo_loss_on_share(model, prompts, completions, behaviour, advantages, masks, cfg, *, pack_tokens: int = 4096):
    """The GRPO loss of this rank's share; with equal token counts per rank the mean over
    ranks (FSDP averages gradients) equals the single-process loss on the whole batch."""
    from learner.grpo import clipped_pg_loss
    from learner.packing import packed_completion_logprobs

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    take = lambda xs: rank_share(xs, rank, world)  # noqa: E731
    new = packed_completion_logprobs(model, take(prompts), take(completions), pack_tokens=pack_tokens)
    loss, stats = clipped_pg_loss(new, take(behaviour), take(advantages), take(masks), cfg)
    return loss, stats
