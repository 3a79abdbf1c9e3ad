"""Device mesh, logical-axis rules, and placing pytrees on the mesh.

The model names logical axes ("embed", "heads", ...); a small rules table maps them to the mesh axes
("data", "fsdp", "tensor"). Axes are Auto (GSPMD propagation) on purpose: we annotate weights and a few
activations and let XLA place the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
DEFAULT_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "layers": None,
    "norm": None,
    "seq": None,
    "cache_seq": None,
    "act_embed": None,
}

_RULES: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("sage_rules", default=None)

# Logical names a rules table need not list (older configs do not): each takes another name's rule when absent.
# "decode_rows": the rows of what a decode step keeps per row (the KV cache, attention, logits and sampling), split
# like "batch" except under decode_rules.
_FALLBACK = {"decode_rows": "batch"}


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Fill in one -1 and check that the mesh uses exactly the devices there are."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(MESH_AXES):
        raise ValueError(f"mesh shape {shape} must have {len(MESH_AXES)} entries for axes {MESH_AXES}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one axis may be -1")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh shape {shape}: sizes must be positive or -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(
                f"mesh shape {shape}: the fixed axes ({known} devices) do not divide the {num_devices} available "
                f"devices; choose sizes whose product divides {num_devices}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"mesh shape {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices but {num_devices} are "
            f"available; set config.mesh.shape so the sizes multiply to {num_devices} (one may be -1)")
    return shape


def make_mesh(shape: Sequence[int] = (1, -1, 1), devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(shape, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def make_meshes(shape: Sequence[int], rollout_devices: int = 0,
                devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, Mesh | None]:
    """(training mesh, rollout mesh or None). rollout_devices = n > 0 splits the devices: the sampler gets the last
    n, as (data = n / tensor, fsdp = 1, tensor = the training mesh's tensor size when it divides n: rows over data,
    weights whole on each data shard), and `shape` is the training mesh's over the rest.

    Across P processes each sub-mesh takes devices of every process (the sampler the last n / P of each, host by
    host, so a tensor group stays in one host when n / P is a multiple of it): JAX's multi-controller runtime needs
    every process to address its share of each mesh. With a sampler mesh of whole hosts (jax 0.10.2, 2 CPU
    processes) the weight copy failed ("device_put's second argument must be a Device or a Sharding which
    represents addressable devices" on the process without sampler devices, "does not support cross-host device
    transfers" on the other), and so did the prompts' device_put and the rows' allgather there."""
    devices = list(jax.devices() if devices is None else devices)
    n = int(rollout_devices)
    if not n:
        return make_mesh(shape, devices), None
    if not 0 < n < len(devices):
        raise ValueError(f"mesh.rollout_devices={n}: the sampler's sub-mesh must leave devices for training (there "
                         f"are {len(devices)}; 0 = sample on the training devices)")
    processes = sorted({d.process_index for d in devices})
    if len(processes) == 1:
        train_devices, rollout = devices[:len(devices) - n], devices[len(devices) - n:]
    else:
        per_host = len(devices) // len(processes)
        if n % len(processes) or n // len(processes) >= per_host:
            raise ValueError(f"mesh.rollout_devices={n} across {len(processes)} processes: each process gives the "
                             f"sampler n / {len(processes)} of its {per_host} devices and keeps at least one for "
                             f"training, so n must be a multiple of {len(processes)} below {len(devices)}")
        own = [[d for d in devices if d.process_index == p] for p in processes]
        cut = per_host - n // len(processes)
        train_devices, rollout = [d for o in own for d in o[:cut]], [d for o in own for d in o[cut:]]
    train = make_mesh(shape, train_devices)
    tensor = train.shape["tensor"] if n % train.shape["tensor"] == 0 else 1
    return train, make_mesh((n // tensor, 1, tensor), rollout)


@functools.lru_cache(maxsize=None)
def _replicator(mesh: Mesh):
    return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))


def copy_to(tree: Any, shardings: Any) -> Any:
    """jax.device_put(tree, shardings) between two meshes, also across processes, where JAX refuses a reshard
    between different device sets: each leaf is first replicated on its own mesh (one all-gather), then every
    process copies the slices its target devices need from its local replica."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, target):
        replicated = _replicator(x.sharding.mesh)(x)
        full = replicated.addressable_shards[0].data
        pieces = [jax.device_put(full[index], device)
                  for device, index in target.addressable_devices_indices_map(x.shape).items()]
        return jax.make_array_from_single_device_arrays(x.shape, target, pieces)
    return jax.tree.map(one, tree, shardings)


def logical_to_spec(axes: Sequence[str | None], rules: Mapping[str, Any] | None = None) -> P:
    rules = DEFAULT_RULES if rules is None else rules
    used: set[str] = set()
    out = []
    for name in axes:
        if name is not None and name not in rules:
            name = _FALLBACK.get(name, name)
        target = rules.get(name) if name is not None else None
        if target is None:
            out.append(None)
            continue
        targets = (target,) if isinstance(target, str) else tuple(target)
        # A mesh axis can shard only one dimension of an array.
        targets = tuple(t for t in targets if t not in used)
        used.update(targets)
        out.append(targets[0] if len(targets) == 1 else (targets or None))
    return P(*out)


def checkdivides(path: str, shape: Sequence[int], spec: P, mesh: Mesh) -> None:
    for dim, (size, entry) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else entry
        n = math.prod(mesh.shape[a] for a in axes)
        if size % n:
            raise ValueError(
                f"{path}: dimension {dim} has size {size}, which does not divide over mesh axes {axes} of size {n}; "
                f"change config.mesh.shape or the logical-axis rules")


def tree_shardings(abstract_tree: Any, axes_tree: Any, mesh: Mesh, rules: Mapping[str, Any] | None = None) -> Any:
    """NamedShardings for a pytree of arrays (or ShapeDtypeStructs) given a matching tree of logical axes."""
    def one(path, leaf, axes):
        spec = logical_to_spec(axes, rules)
        checkdivides(jax.tree_util.keystr(path), leaf.shape, spec, mesh)
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, abstract_tree, axes_tree,
                                            is_leaf=lambda x: isinstance(x, tuple) and all(
                                                isinstance(a, (str, type(None))) for a in x))


@contextlib.contextmanager
def use_rules(rules: Mapping[str, Any] | None):
    token = _RULES.set(rules)
    try:
        yield
    finally:
        _RULES.reset(token)


def current_rules() -> Mapping[str, Any]:
    return _RULES.get() or DEFAULT_RULES


def _mesh_axes(target) -> tuple[str, ...]:
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def decode_rules(stationary_weights: bool = True, rules: Mapping[str, Any] | None = None,
                 dims: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The rules one decode step (a token per row) runs under: `rules` (default the current ones) as they are, or
    with stationary_weights (DecodeForms on TPU and GPU) the weights stay where they lie.

    Training splits rows over data x fsdp and gathers each weight's fsdp shards for its matmul, once per layer per
    step: cheap against a long sequence, but a decode step has one token per row, so that gather would read and write
    every weight of every layer every step (qwen7b_branch on 32 v5p chips: 11.33x the ideal bytes at 64 rows). Here
    the token activations split their embed dim over the weights' embed axes instead ("act_embed" -> "embed"'s
    axes, rows off those axes), so each matmul runs on the local weight shard and reduces a few KB of partial sums per
    row; the cache, attention, logits and sampling keep the rows split as before ("decode_rows").

    dims (logical name -> size: "mlp", "vocab") with a mesh set: where the MLP's hidden dim (the unembedding's
    vocabulary) divides over its own axes and the embed axes together, "decode_mlp" ("decode_vocab") names those
    axes: the decode step's copy of those weights (decoder.decode_params) splits that dim over them and keeps the
    embed dim whole, and so do their activations ("mlp" here, and the logits before they take the rows' layout).
    With the embed dim split instead, every row's partial sums of the whole [rows, F / tensor] hidden were reduced
    across the embed axes in every layer."""
    rules = dict(current_rules() if rules is None else rules)
    if not stationary_weights:
        return rules
    batch, embed = _mesh_axes(rules.get("batch")), _mesh_axes(rules.get("embed"))
    rules.setdefault("decode_rows", rules.get("batch"))
    rules["batch"] = tuple(a for a in batch if a not in embed) or None
    rules["act_embed"] = rules.get("embed")
    mesh = _current_mesh()
    split = tuple(a for a in embed if mesh is not None and mesh.shape[a] > 1)  # embed axes that split something
    for name, wide in (("mlp", "decode_mlp"), ("vocab", "decode_vocab")):
        own = _mesh_axes(rules.get(name))
        axes = own + tuple(a for a in split if a not in own)
        if dims and name in dims and mesh is not None and axes != own and \
                dims[name] % math.prod(mesh.shape[a] for a in axes) == 0:
            rules[wide] = axes
    if "decode_mlp" in rules:
        rules["mlp"] = rules["decode_mlp"]  # the MLP's hidden activations, split like its weights' decode copies
    return rules


def _current_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names) else mesh


def divides(shape: Sequence[int], spec: P, mesh) -> bool:
    sizes = [math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e)) if e else 1 for e in spec]
    return all(n % s == 0 for n, s in zip(shape, sizes))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Annotate an activation with logical axes; a no-op unless a mesh is set (jax.set_mesh)."""
    mesh = _current_mesh()
    if mesh is None:
        return x
    spec = logical_to_spec(axes, current_rules())
    # Skip constraints the shape cannot honour (e.g. a batch of 1 on a 2-way axis) instead of failing.
    return jax.lax.with_sharding_constraint(x, spec) if divides(x.shape, spec, mesh) else x


def per_shard(fn, args: Sequence[jax.Array], axes: Sequence[Sequence[str | None]], out_axes: Sequence[str | None]):
    """fn(*args) run on each device's shards (shard_map) when a mesh is set, the arrays split as their logical axes
    say where the shapes divide (else replicated): for a kernel (Pallas) that XLA cannot partition itself, which
    would otherwise gather its operands whole onto every device."""
    mesh = _current_mesh()
    if mesh is None:
        return fn(*args)
    rules = current_rules()
    spec = lambda shape, names: (lambda s: s if divides(shape, s, mesh) else P())(logical_to_spec(names, rules))
    in_specs = tuple(spec(a.shape, names) for a, names in zip(args, axes))
    out_spec = spec(args[0].shape, out_axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*args)


def data_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Batch-leading arrays: rows over data x fsdp, the rest replicated."""
    return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def initialize_distributed() -> None:
    """Start JAX's multi-controller runtime when the environment asks for it.

    TPU pods: automatic (jax.distributed.initialize() finds the peers). GPU clusters and local multi-process tests:
    set SAGE_COORDINATOR=host:port, SAGE_NUM_PROCESSES, SAGE_PROCESS_ID. Single-process runs: nothing to do.
    """
    coordinator = os.environ.get("SAGE_COORDINATOR")
    if coordinator:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ["SAGE_NUM_PROCESSES"]),
            process_id=int(os.environ["SAGE_PROCESS_ID"]),
            local_device_ids=None,
        )
    elif (os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("CLOUD_TPU_TASK_ID")) and \
            os.environ.get("JAX_PLATFORMS", "") != "cpu":  # CPU runs beside libtpu's host variables stay local
        jax.distributed.initialize()
    if jax.process_count() > 1:
        _orbax_barriers_off_the_devices()


def _orbax_barriers_off_the_devices() -> None:
    """orbax's checkpoint barriers are by default a device collective (sync_global_devices) issued from its commit
    thread, which can land between the training thread's programs in another order on each process (JAX's
    multi-controller rule; jax.thread_guard refuses it). Its flag experimental_orbax_use_distributed_barrier makes
    them barriers of the distributed runtime's coordinator instead, which any thread may wait on."""
    from absl import flags
    import orbax.checkpoint  # noqa: F401  (defines the flag)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # the defaults, as absl.app would parse an empty command line
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


def to_host(tree: Any) -> Any:
    """Device arrays -> numpy. Arrays spread over several processes are all-gathered (every process gets all)."""
    from jax.experimental import multihost_utils

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(jax.device_get(x))
        return np.array(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(one, tree)


def gather(tree: Any) -> Any:
    """The device half of to_host, dispatched and not waited for: each array spread over several processes is
    replicated on its mesh (one all-gather). to_host of the result then reads local copies only, so it may run on
    another thread than the one that issues the multi-process operations (jax.thread_guard)."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated or \
                not isinstance(x.sharding, NamedSharding):
            return x  # local already, or left to to_host's own gather
        return _replicator(x.sharding.mesh)(x)
    return jax.tree.map(one, tree)


def fingerprint(tree: Any) -> str:
    """A digest of the exact bits of every array in `tree`, the same for any sharding or mesh: per leaf, wrapping
    uint32 sums of each element's bits times two odd multipliers of its position (exact, so the order of the
    reduction does not matter), so a changed, moved or swapped element changes it. One pass over the arrays."""
    import hashlib
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    sums = np.asarray(to_host(jax.jit(lambda xs: [_bit_sums(x) for x in xs])([x for _, x in leaves])))
    text = ";".join(f"{jax.tree_util.keystr(p)}:{x.shape}:{x.dtype}" for p, x in leaves)
    return hashlib.sha256(text.encode() + sums.astype("<u4").tobytes()).hexdigest()[:16]


def _bit_sums(x: jax.Array) -> jax.Array:
    import jax.numpy as jnp
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
    pos = sum((jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * np.uint32(math.prod(x.shape[d + 1:]) % 2 ** 32)
               for d in range(x.ndim)), jnp.zeros(x.shape, jnp.uint32))
    return jnp.stack([jnp.sum(bits * (pos * np.uint32(2654435761) | 1)), jnp.sum(bits * (pos * np.uint32(40503) + 7))])


def allgather_rows(local: np.ndarray) -> np.ndarray:
    """Concatenate every process's rows in process order (identity on one process)."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils
    return np.array(multihost_utils.process_allgather(local, tiled=True))  # a writable copy


def local_rows(n: int) -> slice:
    """The contiguous share of n rows this process feeds (and scores)."""
    pc, pi = jax.process_count(), jax.process_index()
    if n % pc:
        raise ValueError(f"{n} rows do not split over {pc} processes; make the batch a multiple of the process count")
    return slice(pi * n // pc, (pi + 1) * n // pc)


def global_batch(local: np.ndarray, mesh: Mesh) -> jax.Array:
    """Assemble a [N, ...] array sharded over data x fsdp from each process's local rows."""
    return jax.make_array_from_process_local_data(data_sharding(mesh, local.ndim), local)
