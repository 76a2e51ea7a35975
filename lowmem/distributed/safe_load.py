"""Reading checkpoint files without running code: a checkpoint from elsewhere is data, never a program.

A pickle may name any Python function and have it called while it loads (`os.system`, say); the CRC in a
checkpoint's completeness marker guards against damage, not against someone who rewrites a file and its CRC. So
every file a resume reads is read as data only, and checked before any rank loads anything:

    safetensors, JSON        data formats: nothing to run
    *.pt (torch.save)        `torch.load(weights_only=True)`: tensors, numbers, strings, lists, dicts (the random
                             states of checkpoints written before they were stored as tensors: numpy arrays too)
    optimizer/ (FSDP)        torch.distributed.checkpoint: its `.metadata` pickle read by an unpickler that knows
                             only that file's own classes (in the check and in torch's reader alike), its small
                             values with `weights_only=True`
    deepspeed/               checked first: every global its pickles name is among the classes DeepSpeed's own
                             writer uses; then read through DeepSpeed's checkpoint engine with `weights_only=True`
                             and those classes allowed (`deepspeed_loads_as_data`)

`check_checkpoint_files` runs the checks on a whole checkpoint folder; a file that names anything else is refused
with `UnsafeCheckpointError` before anything in it runs. `evaluate`, `generate` and `export` read safetensors and
JSON only.
"""

from __future__ import annotations

import importlib
import io
import pickle
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from lowmem.errors import UnsafeCheckpointError


def refusal(path: Path | str, names: Iterable[str]) -> UnsafeCheckpointError:
    """The error for a file that names `names` (module.name of functions or classes)."""
    listed = ", ".join(sorted(set(names))) or "objects that are not plain data"
    return UnsafeCheckpointError(
        f"{path} asks, when loaded, for Python code that a checkpoint lowmem writes never holds ({listed}): it was "
        "not written by lowmem's training, or it was changed since. Loading it could run that code, so it is not "
        "loaded. Resume from a checkpoint you made yourself (--resume_from_checkpoint=PATH names one), or start the "
        "run afresh in another --output_dir.")


# ----- torch.save files ----------------------------------------------------------------------------------------------
def _numpy_array_globals() -> list[Any]:
    """What a pickled numpy array names: its rebuilding function (under numpy 2's module name and numpy 1's: a
    checkpoint keeps the name of the numpy that wrote it), the array type and dtype. Checkpoints written before the
    random states were stored as tensors hold numpy's state as an array."""
    import numpy as np

    # The array's dtype is rebuilt as an instance of its own class in numpy 2 (the generator's key is uint32).
    names: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            rebuild = importlib.import_module(module)._reconstruct
        except (ImportError, AttributeError):
            continue
        names += [(rebuild, "numpy._core.multiarray._reconstruct"), (rebuild, "numpy.core.multiarray._reconstruct")]
        break
    return names


# The globals a torch.save file of each kind may name beyond torch's own data types.
_NUMPY_ARRAY_NAMES = frozenset({"numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct",
                                "numpy.core.multiarray._reconstruct"})


def load_torch_file(path: Path, mmap: bool = False, numpy_arrays: bool = False, classes: Iterable[Any] = ()) -> Any:
    """`torch.load` of `path` as data only (`weights_only=True`), on the CPU.

    Args:
        path: a file written by `torch.save`.
        mmap: map the file's storage instead of reading it (see `torch.load`).
        numpy_arrays: also rebuild numpy arrays (see `_numpy_array_globals`).
        classes: further classes to rebuild (their attributes set as data; never a type's own).
    """
    extra = [*(_numpy_array_globals() if numpy_arrays else []), *classes]
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as error:
        raise refusal(path, unsafe_globals(path)) from error


def unsafe_globals(path: Path) -> list[str]:
    """The globals `path` (a torch.save file) names beyond torch's data types, read from its pickle alone (its
    tensors are not read); a file whose pickle cannot be listed counts as naming something unknown."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - a file that cannot even be listed is not loaded either
        return ["(a pickle that cannot be read)"]


def check_torch_file(path: Path, allowed: Iterable[str] = ()) -> None:
    """Refuse `path` when its pickle names a global outside torch's data types and `allowed`."""
    allowed = set(allowed)
    unknown = [name for name in unsafe_globals(path) if name not in allowed]
    if unknown:
        raise refusal(path, unknown)


# ----- pickles with a list of allowed classes ---------------------------------------------------------------------
class _AllowListUnpickler(pickle._Unpickler):  # the Python one: its opcodes can be checked one by one
    """An unpickler that builds only the globals `allowed(module, name)` accepts, and refuses the rest; it never
    sets attributes on a class, function or module (a pickle could otherwise change an allowed class for the whole
    process)."""

    def __init__(self, file: Any, path: Path, allowed: Callable[[str, str], bool]) -> None:
        super().__init__(file)
        self.path, self.allowed = path, allowed

    def find_class(self, module: str, name: str) -> Any:
        if not self.allowed(module, name):
            raise refusal(self.path, [f"{module}.{name}"])
        return super().find_class(module, name)

    def _build(self) -> None:
        target = self.stack[-2]  # type: ignore[attr-defined]  # BUILD sets the state on the object below it
        if isinstance(target, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                               types.ModuleType)):
            raise refusal(self.path, [f"new attributes for {getattr(target, '__qualname__', target)}"])
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _build}  # type: ignore[dict-item]


def load_pickle_allowing(path: Path, allowed: Callable[[str, str], bool]) -> Any:
    """Unpickle `path`, building only the globals `allowed` accepts; anything else, and a file that does not load
    (no pickle, or a pickle whose allowed calls fail), is an UnsafeCheckpointError: refused, never half-read."""
    try:
        with open(path, "rb") as file:
            return _AllowListUnpickler(file, path, allowed).load()
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever went wrong, the file is refused the same way
        raise refusal(path, []) from error


# ----- torch.distributed.checkpoint (FSDP's sharded optimizer state) -----------------------------------------------
# What the `.metadata` pickle of an optimizer state saved by torch.distributed.checkpoint names (torch 2.6-2.13).
_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                              "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


_TORCH_DTYPE_PREFIXES = ("float", "bfloat", "int", "uint", "bool", "complex", "half", "double", "long", "short",
                         "cfloat", "cdouble")


def _dcp_metadata_allows(module: str, name: str) -> bool:
    if name in _DCP_METADATA_CLASSES.get(module, ()):
        return True
    # torch.float32 and its kin (only dtype-like names are looked up: another name may import a torch submodule).
    return (module == "torch" and name.startswith(_TORCH_DTYPE_PREFIXES)
            and isinstance(getattr(torch, name, None), torch.dtype))


def check_distributed_checkpoint(folder: Path) -> None:
    """Refuse a torch.distributed.checkpoint folder whose metadata names anything but its own classes (what the
    main process checks for every rank before anything is loaded)."""
    for metadata in sorted(folder.glob("*.metadata")):
        load_pickle_allowing(metadata, _dcp_metadata_allows)


def load_distributed_checkpoint(state: dict[str, Any], folder: Path, **options: Any) -> None:
    """`torch.distributed.checkpoint.load` of `folder` into `state`, as data: the metadata checked, then read
    through the allow-list again by the reader itself (`_DataOnlyReader`, not torch's plain unpickling), the small
    values (learning rates, betas, flags) refused unless `weights_only=True` loads them (`safe_load_planner`). A
    refusal on any rank is raised as the UnsafeCheckpointError it is; any other failure as a RuntimeError caused by
    torch's CheckpointException (a BaseException, which would slip past every `except Exception`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_distributed_checkpoint(folder)  # a clear refusal here: inside torch's load it would come back as text
    try:
        dcp.load(state, storage_reader=_data_only_reader(folder), planner=safe_load_planner(folder), **options)
    except CheckpointException as error:
        for failure, _ in error.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise failure from None
        raise RuntimeError(f"torch.distributed.checkpoint could not load {folder}") from error


def _data_only_reader(folder: Path) -> Any:
    """A FileSystemReader of `folder` whose metadata is read through the allow-list."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _DataOnlyReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # What torch's reader does, with the unpickling restricted (lowmem writes one `.metadata` per folder).
            metadata = load_pickle_allowing(folder / ".metadata", _dcp_metadata_allows)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            if hasattr(self, "load_id"):
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return _DataOnlyReader(str(folder))


def safe_load_planner(folder: Path) -> Any:
    """A torch.distributed.checkpoint load planner that reads the small values of `folder` as data: the default one
    unpickles them with `weights_only=False`, so each is first loaded with `weights_only=True`, which refuses
    anything but data, and only then handed on."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            data = value.getvalue()
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except pickle.UnpicklingError as error:
                raise refusal(f"{folder} (its value {read_item.dest_index.fqn})", []) from error
            super().load_bytes(read_item, io.BytesIO(data))

    return SafeLoadPlanner()


# ----- DeepSpeed -------------------------------------------------------------------------------------------------
# What DeepSpeed's checkpoint writer puts in its pickles besides torch's data types (ZeRO stages 1-2: the engine's
# model states and each rank's optimizer states): its loss scaler, its ZeRO stage, the fragments of the flattened
# parameters.
DEEPSPEED_CLASSES = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address")


def _deepspeed_classes() -> list[Any]:
    classes = []
    for qualified in DEEPSPEED_CLASSES:
        module, _, name = qualified.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # an older or newer DeepSpeed without it: its files cannot hold it
            continue
    return classes


def check_deepspeed_checkpoint(folder: Path) -> None:
    """Refuse a DeepSpeed checkpoint folder whose `.pt` files name any global beyond torch's data types and
    DeepSpeed's own classes (what the main process checks for every rank before anything is loaded)."""
    for path in sorted(folder.rglob("*.pt")):
        check_torch_file(path, DEEPSPEED_CLASSES)


@contextmanager
def deepspeed_loads_as_data(engine: Any) -> Iterator[None]:
    """Within the block, DeepSpeed's engine reads its checkpoint files with `weights_only=True` (its own classes
    allowed): its checkpoint engine, through which every read of a checkpoint goes, unpickles them as they are
    otherwise. An engine without one reads them its own way, after `check_deepspeed_checkpoint`."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is None or not callable(getattr(checkpoint_engine, "load", None)):
        yield
        return
    classes = _deepspeed_classes()

    def load(path: Any, map_location: Any = None) -> Any:
        return load_torch_file(Path(path), classes=classes)

    own = vars(checkpoint_engine).get("load")  # set on the instance (else the class's method serves)
    checkpoint_engine.load = load
    try:
        yield
    finally:
        if own is not None:
            checkpoint_engine.load = own
        else:
            del checkpoint_engine.load


def check_checkpoint_files(folder: Path, optimizer_dir: str, deepspeed_dir: str) -> None:
    """Check every file of the checkpoint `folder` that a resume unpickles, before anything is loaded: its
    `.pt` files (the random states may hold numpy arrays of the earlier format, nothing else may), the sharded
    optimizer state's metadata in `optimizer_dir`, DeepSpeed's files in `deepspeed_dir`. Raises
    UnsafeCheckpointError naming the first file that asks for anything else."""
    for path in sorted([*folder.glob("*.pt"), *folder.glob("rank*/*.pt")]):
        check_torch_file(path, _NUMPY_ARRAY_NAMES if path.parent != folder else ())
    if (folder / optimizer_dir).is_dir():
        check_distributed_checkpoint(folder / optimizer_dir)
    if (folder / deepspeed_dir).is_dir():
        check_deepspeed_checkpoint(folder / deepspeed_dir)
