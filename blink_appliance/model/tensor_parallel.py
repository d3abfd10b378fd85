"""Tensor parallelism over two GPUs of one host: each rank holds half the heads and half the MLP.

Megatron's split: QKV and gate+up by output columns (each rank its own attention heads, KV heads and
MLP columns), O and down by input rows, so each rank's O and down produce a share of the full
product. The norm after them adds the two shares (kernels/rmsnorm.py `PeerShare`): each rank reads
the peer's share from the peer's memory over NVLink once the peer's flag for that point carries the
step's epoch, and both add rank 0's share first, so the residual streams of the two ranks stay
bit-identical without any collective library. Embedding, norms and the LM head are replicated; only
rank 0 needs the logits.

Both ranks' forwards live in one process (peer access between the devices), built with
`shard_config` / `shard_weights`, then joined with `connect`: each step both must run, in lockstep,
since every norm after O or down waits for the peer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from blink_appliance.model.config import ModelConfig
from blink_appliance.model.gpu_weights import GpuWeights, LayerWeights, in_major

TP_SIZES = (1, 2)


def check_shardable(config: ModelConfig, size: int) -> None:
    """Refuse what the split cannot do, naming why."""
    if size not in TP_SIZES:
        raise ValueError(f"tensor_parallel must be one of {TP_SIZES}, got {size}")
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(config, name) % size:
            raise ValueError(
                f"tensor_parallel {size} does not divide the model's {name} {getattr(config, name)}"
            )


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """One rank's view of the model: its heads, KV heads and MLP columns."""
    check_shardable(config, size)
    return replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=config.num_kv_heads // size,
        intermediate_size=config.intermediate_size // size,
    )


def _rows(matrix: torch.Tensor, parts: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The [out, in] view's rows in `parts` ((start, length) each), stacked, stored input-major."""
    return in_major(torch.cat([matrix[a : a + n] for a, n in parts]).to(device))


def _cols(matrix: torch.Tensor, start: int, length: int, device: torch.device) -> torch.Tensor:
    return in_major(matrix[:, start : start + length].to(device))


def shard_weights(
    weights: GpuWeights, config: ModelConfig, rank: int, size: int, device: torch.device | str
) -> GpuWeights:
    """Rank `rank`'s weights on `device`, from the whole model's (any device)."""
    check_shardable(config, size)
    device = torch.device(device)
    q, kv, inter = config.q_size // size, config.kv_size // size, config.intermediate_size // size
    qkv_parts = [
        (rank * q, q),
        (config.q_size + rank * kv, kv),
        (config.q_size + config.kv_size + rank * kv, kv),
    ]

    def vec(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    layers = [
        LayerWeights(
            input_norm=vec(layer.input_norm),
            qkv=_rows(layer.qkv, qkv_parts, device),
            qkv_bias=None
            if layer.qkv_bias is None
            else torch.cat([layer.qkv_bias[a : a + n] for a, n in qkv_parts]).to(device),
            q_norm=vec(layer.q_norm),
            k_norm=vec(layer.k_norm),
            o_proj=_cols(layer.o_proj, rank * q, q, device),
            post_norm=vec(layer.post_norm),
            gate_up=_rows(
                layer.gate_up,
                [(rank * inter, inter), (config.intermediate_size + rank * inter, inter)],
                device,
            ),
            down=_cols(layer.down, rank * inter, inter, device),
        )
        for layer in weights.layers
    ]
    embed = weights.embed.to(device)
    lm_head = embed if weights.lm_head is weights.embed else weights.lm_head.to(device)
    return GpuWeights(embed=embed, layers=layers, norm=weights.norm.to(device), lm_head=lm_head)


def shard_kv_heads(cache: torch.Tensor, rank: int, size: int, device: torch.device | str) -> torch.Tensor:
    """Rank `rank`'s KV heads of a cache [layers, blocks, block_size, kv_heads, head_dim]."""
    per = cache.shape[3] // size
    return cache[:, :, :, rank * per : (rank + 1) * per].contiguous().to(device)


@dataclass
class RankLink:
    """What one rank's forward holds for the exchange: its rank, the step's epoch and the flags the
    peer writes (one per O and down of every layer), and the peer's forward once connected."""

    rank: int
    epoch: torch.Tensor  # int32 [1]
    flags: torch.Tensor  # int32 [2 * num_layers]
    peer: object | None = None  # the peer rank's GpuForward
    # Solo: the rank exchanges with itself (its own share and flags stand in for the peer's), so it
    # runs alone. Only to compile and load its kernels (`warm_alone`); its numbers are wrong.
    solo: bool = False

    @classmethod
    def allocate(cls, rank: int, num_layers: int, device: torch.device) -> RankLink:
        zeros = torch.zeros(1 + 2 * num_layers, dtype=torch.int32, device=device)
        return cls(rank=rank, epoch=zeros[:1], flags=zeros[1:])


def enable_peer_access(a: torch.device, b: torch.device) -> None:
    """Let kernels on a read b's memory and the other way round (a cross-device copy each way
    makes torch enable peer access); refused where the GPUs cannot reach each other."""
    if a.type != "cuda" or b.type != "cuda":
        return
    if not torch.cuda.can_device_access_peer(a, b) or not torch.cuda.can_device_access_peer(b, a):
        raise RuntimeError(
            f"{a} and {b} have no peer access: tensor parallelism needs it (NVLink or PCIe P2P)"
        )
    x, y = torch.zeros(1, device=a), torch.zeros(1, device=b)
    x.copy_(y)
    y.copy_(x)
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)


def warm_alone(ranks: list, step) -> None:
    """Run `step(forward)` once per rank, each alone (solo), then zero the epochs and flags.

    Every kernel must be compiled and loaded on its device before the ranks wait on each other: the
    first launch of a kernel loads its module, and a load may wait for the device to go idle, which
    a rank spinning on its peer's flag never does while the host is stuck in the load."""
    for fwd in ranks:
        fwd.tp.solo = True
    try:
        for fwd in ranks:
            with torch.cuda.device(fwd.device) if fwd.device.type == "cuda" else _nothing():
                step(fwd)
            if fwd.device.type == "cuda":
                torch.cuda.synchronize(fwd.device)
    finally:
        for fwd in ranks:
            fwd.tp.solo = False
            fwd.tp.epoch.zero_()
            fwd.tp.flags.zero_()


class _nothing:
    def __enter__(self) -> None: ...

    def __exit__(self, *exc: object) -> None: ...


def connect(first, second) -> None:
    """Join two ranks' forwards (rank 0's and rank 1's GpuForward) so their steps can run."""
    if first.tp is None or second.tp is None or (first.tp.rank, second.tp.rank) != (0, 1):
        raise ValueError("connect takes rank 0's and rank 1's forwards, both built with a tp rank")
    enable_peer_access(first.device, second.device)
    first.tp.peer, second.tp.peer = second, first
