"""``moecompile.load_hf_checkpoint``: a transformers checkpoint (the safetensors files ``save_pretrained`` writes and
the Hub holds) loaded into a model, each rank reading from disk only what it holds; ``save_hf_checkpoint``: a model
written as one, a decoder layer at a time.

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    moecompile.parallelize(model, mesh, example_ids).to_empty(device="cuda")
    model.init_weights()                                   # what no checkpoint holds (rotary buffers)
    moecompile.load_hf_checkpoint(model, path)             # every rank, together

The checkpoint keeps transformers' names and layouts on disk (Mixtral: each expert's ``w1``, ``w2``, ``w3``; the
model holds them stacked, ``gate_up_proj`` the concatenation of ``w1`` and ``w3``). transformers' own conversion
of the model's family maps them (``get_model_conversion_mapping``, the renamings and converters ``from_pretrained``
applies), and its ``DtensorShardOperation`` cuts each read to what a DTensor of the model's ``state_dict()`` holds on
this rank: an expert another rank holds is not read at all, a stacked checkpoint tensor is read in this rank's rows
(safetensors reads slices from the file's memory map), FSDP2's dense shards likewise; a weight the model holds whole
is read whole. The pieces go through the model's ``load_state_dict``, so swapped experts go to their slots and TED
cuts the intermediate size, as for any checkpoint (``sharded_state.py``, ``ted.py``).

Reads are cast to the dtype of the model's weight and made on its device, one weight at a time (read, converted,
loaded, dropped: the peak is one weight's pieces, not a second copy of the model). A head tied to the input
embedding, which checkpoints leave out, is loaded from it. fp8 and fp4 weights with block scales beside them
(DeepSeek-V3's and V4's official checkpoints) are read dequantized (``fp8_read.py``). Refused: weights the checkpoint
lacks (``strict``: after ``to_empty`` they would hold whatever memory held) and other quantized tensors for
floating-point weights (integers, fp8 without scales: a cast would load other values; dequantize such a checkpoint
once).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import json
import os

import torch
import torch.distributed as dist
from torch.nn.modules.module import _IncompatibleKeys

from . import fp8_read
from .mesh import stage_group
from .replicate import state_keys
from .sharded_state import unwrapped, whole_groups

INDEX = "model.safetensors.index.json"


def load_hf_checkpoint(model, path, *, strict: bool = True) -> _IncompatibleKeys:
    """Load the transformers checkpoint in directory ``path`` into ``model`` (a transformers model, parallelized
    or not, or its ``torch.compile`` wrapper or pipeline stage), each rank reading only what it holds; call it on
    every rank together (a layer that swaps experts exchanges them in ``state_dict()`` and ``load_state_dict``).
    Returns torch's ``(missing_keys, unexpected_keys)``: the model's weights the checkpoint lacks (``strict``: a
    ``ValueError`` instead) and the checkpoint's tensors this rank's model has no weight for (a pipeline stage's: the
    other stages')."""
    from torch.distributed.tensor import DTensor

    try:
        from transformers import core_model_loading as hf_loading
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.distributed.sharding_utils import DtensorShardOperation
    except ImportError as e:  # (a transformers too old for shard-on-read: before 5.x)
        raise ImportError(f"load_hf_checkpoint needs transformers>=5 with shard-on-read loading: {e}") from e
    model = unwrapped(model)
    files = checkpoint_files(path)
    target = {name: _shape_of(value) for name, value in model.state_dict().items()}  # (values dropped)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, hf_loading.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, hf_loading.WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    loaded, together, pending = set(), state_keys(model), {}  # (a replicating layer's weights: loaded at once)

    def name_of(key: str) -> tuple[str, str | None]:
        """The model's name for checkpoint ``key``, and the converter's pattern it matched (None: renamed only)."""
        name, pattern = hf_loading.rename_source_key(key, renamings, converters, prefix, target)
        if name not in target and key in target:  # (a renaming meant for another key: from_pretrained's rule)
            name, pattern = hf_loading.rename_source_key(key, [], [], prefix, target)
        return name, pattern

    with _opened(files) as tensors:  # (fp8 and fp4 blocks read as floats)
        tensors, scales = fp8_read.dequantized(tensors, lambda key: target.get(name_of(key)[0], (None,))[0], path)
        loads, unexpected = {}, []
        for key in sorted(set(tensors) - scales, key=hf_loading.dot_natural_key):  # (each list in expert order)
            name, pattern = name_of(key)
            if name not in target:
                unexpected.append(key)
                continue
            ref, device = target[name]
            _check_dtype(key, tensors[key], ref, path)
            if pattern is None:
                load, pattern, index = loads.setdefault(name, hf_loading.WeightRenaming(key, name)), key, None
            else:  # the n-th tensor of a converter's list: its sharding tells whether this rank holds it
                load = loads.setdefault(name, copy.deepcopy(by_pattern[pattern]))
                index = len(load.collected_tensors.get(pattern, []))
            # a replicating layer's fused gate/up weight: its hosts' rows run across gate and up, which transformers'
            # shard-on-read would cut each on its own (_FusedRows reads each source's share of the rows)
            fused = name in together and pattern in by_pattern and len(by_pattern[pattern].source_patterns) > 1
            cut = DtensorShardOperation(ref) if isinstance(ref, DTensor) and not fused else \
                _FusedRows.of(ref, by_pattern[pattern], pattern) if fused else None
            load.add_tensor(name, key, pattern,
                            hf_loading.spawn_materialize(None, tensors[key], device, ref.dtype, cut, index))
        for first, load in loads.items():  # one weight (or a few, split from one tensor) read and loaded at a time
            try:
                converted = load.convert(first, model=model, config=getattr(model, "config", None))
            except Exception as e:
                raise ValueError(f"{path}: transformers' conversion of the checkpoint into {first} failed "
                                 f"({type(e).__name__}: {e}): is it a checkpoint of this model's family and "
                                 "configuration?") from e
            state = {name: _as_target(name, value[0] if isinstance(value, list) else value, target[name][0], path)
                     for name, value in converted.items()}
            layer = next((together[name] for name in state if name in together), None)
            if layer is not None:  # held until every weight of its layer is read (left out where some never is)
                pending.setdefault(layer, {}).update(state)
                if not layer[0] <= pending[layer].keys():
                    continue
                state = pending.pop(layer)
            model.load_state_dict(state, strict=False)  # (every rank in the same order: swapped layers exchange)
            loaded |= state.keys()
    # a replicating layer the checkpoint holds some weights of: with strict=False the rest keep their values (every
    # rank: the same layers are pending on each; strict raises below)
    for (keys, where), state in ({} if strict else pending).items():
        current = model.get_submodule(where).state_dict(prefix=f"{where}." if where else "")  # (that layer's alone)
        model.load_state_dict({**{k: current[k] for k in keys - state.keys()}, **state}, strict=False)
        loaded |= state.keys()
    loaded |= _tie(model, loaded, target)
    missing = sorted(set(target) - loaded)
    if strict and missing:
        raise ValueError(f"{path} lacks {len(missing)} weights of the model ({', '.join(missing[:6])}"
                         f"{', ...' if len(missing) > 6 else ''}): after to_empty they would hold whatever memory "
                         "held. Load a checkpoint of this model's family and configuration, or pass strict=False "
                         "to load the rest and initialize those yourself")
    return _IncompatibleKeys(missing, unexpected)


def save_hf_checkpoint(model, path, *, max_shard_size: int = 5 << 30) -> None:
    """Write ``model`` (parallelized or not, its ``torch.compile`` wrapper or pipeline stages) to directory ``path``
    as a transformers checkpoint (``save_pretrained``'s: safetensors in transformers' names and layouts on disk, an
    index, the config), a decoder layer at a time: the layers dealt out in turn to the ranks holding them (of each
    stage under pipeline stages), each layer's weights sent whole to its rank's host alone (``whole_groups``: each
    shard sent once, no device holding more than its shards and one shard more), turned into the disk layout
    (transformers' ``revert_weight_conversion``) and written there in files of at most about ``max_shard_size``
    bytes, each rank writing its files while the others go on (a thread). Every rank calls it together; a host
    holds a layer and the files it is writing, never the model (``full_state_dict`` + ``save_pretrained`` hold it
    whole on every rank); rank 0 writes the index and the config. ``path`` must be a directory every rank sees (a
    shared filesystem across hosts). A model ``parallelize`` did not shard is written by every rank, a layer each in
    turn: every rank must hold all of it (replicated, or FSDP2 over the world), not one pipeline stage of it."""
    from safetensors.torch import save_file

    model = unwrapped(model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    info = getattr(model, "_moe_parallel", None)
    group = stage_group(info.mesh) if info is not None and world > 1 else None
    writers = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    me = dist.get_rank() if dist.is_initialized() else 0
    tied = _tied_away(model)
    weight_map, pending, size, total = {}, {}, 0, 0
    os.makedirs(path, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        writing = None

        def flush():
            nonlocal pending, size, writing
            if writing is not None:
                writing.result()  # (one file in flight: the host holds it and the next)
            if pending:
                name = f"model-rank{me:05d}-{len({*weight_map.values()}) + 1:05d}.safetensors"
                writing = thread.submit(save_file, pending, os.path.join(path, name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(pending, name))
            pending, size = {}, 0

        for _, weights in whole_groups(model, writers):
            if weights is None:
                continue  # (another rank's layer: this rank sent its shards)
            weights = {name: value for name, value in weights.items() if name not in tied}
            for name, value in _disk_layout(model, weights).items():
                pending[name] = value.contiguous().clone()  # (views of one tensor: safetensors writes each alone)
                size += value.numel() * value.element_size()
                total += value.numel() * value.element_size()
            if size >= max_shard_size:
                flush()
        flush()
        if writing is not None:
            writing.result()  # (the last file written; its error raised here)
    maps = [(weight_map, total)]
    if dist.is_initialized():
        maps = [None] * world
        dist.all_gather_object(maps, (weight_map, total))
    if me == 0:
        index = {"metadata": {"total_size": sum(t for _, t in maps)},
                 "weight_map": dict(sorted(kv for m, _ in maps for kv in m.items()))}
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump(index, f, indent=2)
        for part in ("config", "generation_config"):
            if getattr(model, part, None) is not None:
                getattr(model, part).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()  # (every file written before any rank returns)


def checkpoint_files(path) -> list[str]:
    """The safetensors files of the checkpoint directory ``path`` (sharded: those its index names)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory: load_hf_checkpoint reads a checkpoint directory as "
                         "save_pretrained writes it (for a Hub model: huggingface_hub.snapshot_download(repo_id) "
                         "first)")
    if os.path.exists(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in names]
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if names:
        return [os.path.join(path, name) for name in names]
    bins = [n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth"))]
    raise ValueError(f"{path} holds no safetensors files{f' (it holds {bins[0]})' if bins else ''}: "
                     "load_hf_checkpoint reads slices of safetensors files; convert a pickled checkpoint once "
                     "(transformers' from_pretrained, then save_pretrained, writes safetensors)")


_RECORDS: list[dict] = []  # reads() blocks running


@contextlib.contextmanager
def reads():
    """Every read ``load_hf_checkpoint`` makes from the files in the block: checkpoint key -> the elements each
    read gave (what a rank read: tests and ``benchmarks/meta_families.py``)."""
    _RECORDS.append({})
    try:
        yield _RECORDS[-1]
    finally:
        _RECORDS.pop()


class _Recorded:
    """A safetensors slice that records how many elements each read gives."""

    def __init__(self, key: str, piece, into: dict):
        self.key, self.piece, self.into = key, piece, into

    def get_shape(self):
        return self.piece.get_shape()

    def get_dtype(self):
        return self.piece.get_dtype()

    def __getitem__(self, index):
        out = self.piece[index]
        self.into.setdefault(self.key, []).append(out.numel())
        return out


@contextlib.contextmanager
def _opened(files: list[str]):
    """Every tensor of ``files`` by name, as safetensors slices (read when indexed); the files closed on exit, those
    opened before one that fails to open too."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        tensors = {}
        for file in files:
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            tensors.update({key: handle.get_slice(key) for key in handle.keys()})
            tensors.update({key: fp8_read.Fp4Whole(handle, key) for key in handle.keys()
                            if tensors[key].get_dtype() == "F4"})
        if _RECORDS:
            tensors = {key: _Recorded(key, piece, _RECORDS[-1]) for key, piece in tensors.items()}
        yield tensors


class _FusedRows:
    """Shard-on-read of one source of a replicating layer's fused weight (gate and up concatenated along the
    dimension the hosts cut, ``Shard(d)`` of the layer's ``[E, ...]`` over its hosts' mesh, nested over
    ``"dp_shard"`` where the master parts are in shares): of this source's rows along it, those inside this rank's
    piece of the fused dimension (none, some or all), so a rank reads its 1/W of the weight (1/(W R) in shares),
    the concatenation then this rank's piece."""

    def __init__(self, dim: int, lo: int, hi: int, ndim: int):
        self.dim, self.lo, self.hi, self.ndim = dim, lo, hi, ndim  # (lo, hi: within this source's rows)

    @classmethod
    def of(cls, ref, converter, pattern: str):
        """The cut of ``pattern``'s tensors for the DTensor ``ref``; None (read whole) unless the converter
        concatenates equal sources along the dimension ``ref`` cuts."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        joins = [op for op in converter.operations if type(op).__name__ == "Concatenate"]
        if not isinstance(ref, DTensor) or not all(isinstance(p, (Shard, Replicate)) for p in ref.placements):
            return None
        dims = {p.dim for p in ref.placements if isinstance(p, Shard)}  # (nested over "dp_shard": one dimension)
        dim, count = (dims.pop() if len(dims) == 1 else None), len(converter.source_patterns)
        if dim is None or len(joins) != 1 or joins[0].dim != dim or ref.shape[dim] % count:
            return None
        size, start = compute_local_shape_and_global_offset(ref.shape, ref.device_mesh, ref.placements)
        rows = cls.rows(ref.shape[dim], count, converter.source_patterns.index(pattern), start[dim],
                        start[dim] + size[dim])
        return cls(dim, *rows, ref.ndim)

    @staticmethod
    def rows(size: int, count: int, position: int, lo: int, hi: int) -> tuple[int, int]:
        """Of ``count`` equal sources concatenated into ``size`` rows, the rows of the one at ``position`` inside
        ``[lo, hi)`` (this rank's), as rows of that source (lo == hi: none)."""
        width, begin = size // count, position * (size // count)
        first = min(max(lo - begin, 0), width)
        return first, max(min(hi - begin, width), first)

    def shard_tensor(self, source, tensor_idx=None, device=None, dtype=None) -> torch.Tensor:
        shape = list(source.shape) if isinstance(source, torch.Tensor) else source.get_shape()
        d = self.dim - (self.ndim - len(shape))  # (one expert's tensor: no expert dimension)
        if self.hi == self.lo:  # (none of this source's rows: nothing read)
            return torch.empty([0 if i == d else n for i, n in enumerate(shape)], device=device, dtype=dtype)
        index = [slice(None)] * len(shape)
        index[d] = slice(self.lo, self.hi)
        return source[tuple(index)].to(device=device, dtype=dtype)


def _as_target(name: str, value: torch.Tensor, ref, path) -> torch.Tensor:
    """``value`` (this rank's piece of weight ``name``) as ``load_state_dict`` takes it for ``ref``, the model's
    state_dict entry: a DTensor's local shard wrapped as that DTensor; a weight read whole, as it is."""
    from torch.distributed.tensor import DTensor

    want = ref.to_local().shape if isinstance(ref, DTensor) else ref.shape
    if isinstance(ref, DTensor) and value.shape == ref.shape:
        return value
    if value.shape != want:
        raise ValueError(f"{path}: {name} is {tuple(value.shape)} on this rank from the checkpoint, the model "
                         f"holds {tuple(want)}: a checkpoint of another configuration?")
    if isinstance(ref, DTensor):
        return DTensor.from_local(value, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                                  stride=ref.stride())
    return value


def _tie(model, loaded: set, target: dict) -> set:
    """A weight tied to another (the head to the input embedding: ``all_tied_weights_keys``, target -> source),
    which checkpoints leave out, takes its source's value: the names so loaded."""
    tied = {name: source for name, source in (getattr(model, "all_tied_weights_keys", None) or {}).items()
            if name in target and name not in loaded and source in loaded}
    if tied:
        model.load_state_dict({name: model.get_parameter(source).detach() for name, source in tied.items()},
                              strict=False)
    return set(tied)


def _shape_of(value) -> tuple:
    """A state_dict entry as the loading needs it, its values dropped: (a meta tensor of its shape and dtype, or the
    DTensor of such a local shard on its mesh; the device its values live on)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return torch.empty_like(value, device="meta"), value.device
    local = value.to_local()
    shell = DTensor.from_local(torch.empty_like(local, device="meta"), value.device_mesh, value.placements,
                               run_check=False, shape=value.shape, stride=value.stride())
    return shell, local.device


def _check_dtype(key: str, piece, ref, path) -> None:
    """A quantized tensor for a floating-point weight that ``fp8_read`` does not dequantize (integers, fp8 or fp4
    without block scales beside it): casting it would load other values."""
    stored = piece.get_dtype()
    if ref.is_floating_point() and stored.startswith(("F8", "F4", "I", "U")) and not str(ref.dtype).startswith(
            "torch.float8"):
        raise ValueError(f"{path}: {key} is stored as {stored} (a quantized checkpoint), the model's weight is "
                         f"{ref.dtype}: load_hf_checkpoint dequantizes fp8 and fp4 weights with their block scales "
                         f"beside them ({', '.join(fp8_read.SCALES)}), and this is not one. Dequantize the checkpoint "
                         "once (transformers' from_pretrained with its quantization config, dequantize=True, then "
                         "save_pretrained)")


def _tied_away(model) -> set[str]:
    """The weights a checkpoint leaves out: those tied to another (the head to the input embedding), the same
    tensor (``all_tied_weights_keys``: target -> source; ``save_pretrained`` drops them too)."""
    out = set()
    for name, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        try:
            if model.get_parameter(name) is model.get_parameter(source):
                out.add(name)
        except AttributeError:  # (not a parameter of this stage)
            continue
    return out


def _disk_layout(model, weights: dict) -> dict:
    """``weights`` (a decoder layer's, whole) in transformers' names and layouts on disk (its conversion of the
    model's family reverted, as ``save_pretrained`` does); a model transformers does not know: as they are."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return weights
    return revert_weight_conversion(model, weights) if isinstance(model, PreTrainedModel) else weights
