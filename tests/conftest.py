"""Session-wide test setup. The Triton kernels run under Triton's CPU interpreter in every test
module: TRITON_INTERPRET=1 is set here, before any test module is imported. Modules that set it
themselves were too late whenever another module had imported triton first (the interpreter is
chosen at import), e.g. test_attention_backends.py after test_torch_batched.py. The serving
tests share one saved tiny model folder (`serve_model_folder`).

The repository root goes to the end of `sys.path` here (`python -m pytest` puts the working
directory first): at the front, its `kernels/` folder would shadow Hugging Face's `kernels`
package, which transformers imports when it is installed (transformers 5.x requires it). Our
kernels are imported as `hybrid_cache.kernels`; the root stays on the path for `tests.*` imports."""

import os
import sys
from pathlib import Path

import pytest

os.environ["TRITON_INTERPRET"] = "1"

_ROOT = Path(__file__).resolve().parent.parent
_AT_ROOT = [entry for entry in sys.path if Path(entry or os.getcwd()).resolve() == _ROOT]
sys.path[:] = [entry for entry in sys.path if entry not in _AT_ROOT] + [str(_ROOT)]


@pytest.fixture(scope="session")
def serve_model_folder(tmp_path_factory):
    """The tiny serve model (`serve_model.py`), saved once for every serving test."""
    from serve_model import save_serve_model

    return save_serve_model(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread while a module's tests run (`pytestmark =
    pytest.mark.usefixtures("one_torch_thread")`): the CPU here is shared, and more threads
    make these tiny matmuls slower, not faster."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
