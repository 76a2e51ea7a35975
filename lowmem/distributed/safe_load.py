"""Reading checkpoint files without running code: a checkpoint from elsewhere is data, never a program.

A pickle may name any Python function and have it called while it loads (`os.system`, say); the CRC in a
checkpoint's completeness marker guards against damage, not against someone who rewrites a file and its CRC. So
every file a resume reads is read as data only, and checked before any rank loads anything:

    safetensors, JSON        data formats: nothing to run
    *.pt (torch.save)        `torch.load(weights_only=True)`: tensors, numbers, strings, lists, dicts (the random
                             states of checkpoints written before they were stored as tensors: numpy arrays too)
    optimizer/ (FSDP)        torch.distributed.checkpoint: its `.metadata` pickle read by an unpickler that knows
                             only that file's own classes, its small values with `weights_only=True`
    deepspeed/               read by DeepSpeed itself, after every global its pickles name was found among the
                             classes DeepSpeed's own writer uses

`check_checkpoint_files` runs the checks on a whole checkpoint folder; a file that names anything else is refused
with `UnsafeCheckpointError` before anything in it runs. `evaluate`, `generate` and `export` read safetensors and
JSON only.
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from lowmem.errors import UnsafeCheckpointError


def refusal(path: Path | str, names: Iterable[str]) -> UnsafeCheckpointError:
    """The error for a file that names `names` (module.name of functions or classes)."""
    listed = ", ".join(sorted(set(names))) or "objects that are not plain data"
    return UnsafeCheckpointError(
        f"{path} asks, when loaded, for Python code that a checkpoint lowmem writes never holds ({listed}): it was "
        "not written by lowmem's training, or it was changed since. Loading it could run that code, so nothing of "
        "this checkpoint was loaded. Resume from a checkpoint you made yourself (--resume_from_checkpoint=PATH "
        "names one), or start the run afresh in another --output_dir.")


# ----- torch.save files ----------------------------------------------------------------------------------------------
def numpy_array_globals() -> list[Any]:
    """What a pickled numpy array names: its rebuilding function (numpy 2's module or numpy 1's), the array type and
    dtype. Checkpoints written before the random states were stored as tensors hold numpy's state as an array."""
    import numpy as np

    # The array's dtype is rebuilt as an instance of its own class in numpy 2 (the generator's key is uint32).
    names: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            names.append(importlib.import_module(module)._reconstruct)
            break
        except (ImportError, AttributeError):
            continue
    return names


# The globals a torch.save file of each kind may name beyond torch's own data types.
_NUMPY_ARRAY_NAMES = frozenset({"numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct",
                                "numpy.core.multiarray._reconstruct"})


def load_torch_file(path: Path, mmap: bool = False, numpy_arrays: bool = False) -> Any:
    """`torch.load` of `path` as data only (`weights_only=True`), on the CPU.

    Args:
        path: a file written by `torch.save`.
        mmap: map the file's storage instead of reading it (see `torch.load`).
        numpy_arrays: also rebuild numpy arrays (see `numpy_array_globals`); nothing else is added.
    """
    extra = numpy_array_globals() if numpy_arrays else []
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
    unknown = [name for name in unsafe_globals(path) if name not in set(allowed)]
    if unknown:
        raise refusal(path, unknown)


# ----- pickles with a list of allowed classes ---------------------------------------------------------------------
class _AllowListUnpickler(pickle.Unpickler):
    """An unpickler that builds only the globals `allowed(module, name)` accepts, and refuses the rest."""

    def __init__(self, file: Any, path: Path, allowed: Callable[[str, str], bool]) -> None:
        super().__init__(file)
        self.path, self.allowed = path, allowed

    def find_class(self, module: str, name: str) -> Any:
        if not self.allowed(module, name):
            raise refusal(self.path, [f"{module}.{name}"])
        return super().find_class(module, name)


def load_pickle_allowing(path: Path, allowed: Callable[[str, str], bool]) -> Any:
    """Unpickle `path`, building only the globals `allowed` accepts (UnsafeCheckpointError for any other, and for
    a file that is no pickle)."""
    try:
        with open(path, "rb") as file:
            return _AllowListUnpickler(file, path, allowed).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
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


def _dcp_metadata_allows(module: str, name: str) -> bool:
    if name in _DCP_METADATA_CLASSES.get(module, ()):
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)  # torch.float32 and its kin


def check_distributed_checkpoint(folder: Path) -> None:
    """Refuse a torch.distributed.checkpoint folder whose metadata names anything but its own classes (torch's
    reader unpickles it as it is); its small values are read by `safe_load_planner`'s rule."""
    for metadata in sorted(folder.glob("*.metadata")):
        load_pickle_allowing(metadata, _dcp_metadata_allows)


def load_distributed_checkpoint(state: dict[str, Any], folder: Path, **options: Any) -> None:
    """`torch.distributed.checkpoint.load` of `folder` into `state`, as data: its metadata checked first
    (`check_distributed_checkpoint`), its small values read by `safe_load_planner`. A refusal on any rank is raised
    as the UnsafeCheckpointError it is (torch wraps a rank's failure in a CheckpointException, a BaseException)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_distributed_checkpoint(folder)
    try:
        dcp.load(state, checkpoint_id=str(folder), planner=safe_load_planner(), **options)
    except CheckpointException as error:
        for failure, _ in error.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise failure from None
        raise


def safe_load_planner() -> Any:
    """A torch.distributed.checkpoint load planner that reads the small values (learning rates, betas, flags) as
    data: the default one unpickles them with `weights_only=False`, so each is first loaded with
    `weights_only=True`, which refuses anything but data, and only then handed on."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            data = value.getvalue()
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except pickle.UnpicklingError as error:
                raise refusal(f"the value {read_item.dest_index.fqn} of a sharded optimizer state", []) from error
            super().load_bytes(read_item, io.BytesIO(data))

    return SafeLoadPlanner()


# ----- DeepSpeed -------------------------------------------------------------------------------------------------
# What DeepSpeed's checkpoint writer puts in its pickles besides torch's data types (ZeRO stages 1-2: the engine's
# model states and each rank's optimizer states): its loss scaler, its ZeRO stage, the fragments of the flattened
# parameters, and the containers and helpers pickle uses to rebuild them.
DEEPSPEED_GLOBALS = frozenset({
    "collections.OrderedDict", "builtins.set", "builtins.frozenset", "builtins.slice", "builtins.object",
    "copyreg._reconstructor", "argparse.Namespace",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
})


def check_deepspeed_checkpoint(folder: Path) -> None:
    """Refuse a DeepSpeed checkpoint folder whose `.pt` files name any global outside what DeepSpeed's writer
    uses (DeepSpeed's loader unpickles them with `weights_only=False`); nothing in them runs before this check."""
    for path in sorted(folder.rglob("*.pt")):
        check_torch_file(path, DEEPSPEED_GLOBALS)


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
