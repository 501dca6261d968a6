"""What ``dflash-trt triton export --force`` may replace: a model folder it wrote itself, nothing else.

A folder written by the exporter holds ``config.pbtxt`` and one version folder with the model file
(``1/model.py``, or ``1/model.yaml`` for the TensorRT-LLM ``llmapi`` variant); tritonserver may add
``__pycache__`` folders beside a ``model.py``. A plain file, a link, or a folder holding anything else
is a user's and is refused, with or without ``--force`` (the rule ``build --force`` follows for engine
folders, docs/design.md §3.1).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dflash_trt.errors import ServingError


def _written_files(folder: Path) -> set[str]:
    """Relative paths of the files under ``folder``, bytecode caches left out."""
    return {path.relative_to(folder).as_posix() for path in folder.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


def replace_model_folder(model_dir: Path, files: set[str], force: bool) -> None:
    """Make way for a new model folder: nothing to do when absent; remove it when ``force`` and it holds only
    ``files`` (what the exporter writes there); refuse everything else with the fix."""
    if not model_dir.exists() and not model_dir.is_symlink():
        return
    if model_dir.is_symlink() or not model_dir.is_dir():
        raise ServingError(f"{model_dir}: exists and is not a model folder (a file or a link); expected a new "
                           "model folder or one `dflash-trt triton export` wrote (--force never deletes other "
                           "files). Fix: pass another --name or --repo, or move it away.")
    found = _written_files(model_dir)
    extra = sorted(found - files)
    if extra:
        shown = ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")
        raise ServingError(f"{model_dir}: holds files `dflash-trt triton export` did not write ({shown}); expected "
                           f"only {sorted(files)} (--force replaces only a model folder it wrote). Fix: pass another "
                           "--name or --repo, or move those files away.")
    if not force:
        raise ServingError(f"{model_dir}: already exists; expected a new model folder. Fix: pass --force to "
                           "replace it, or --name to write another model.")
    shutil.rmtree(model_dir)
