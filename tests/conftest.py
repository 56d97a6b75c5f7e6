"""Session-wide test setup. The Triton kernels run under Triton's CPU interpreter in every test
module: TRITON_INTERPRET=1 is set here, before any test module is imported. Modules that set it
themselves were too late whenever another module had imported triton first (the interpreter is
chosen at import), e.g. test_attention_backends.py after test_torch_batched.py."""

import os

os.environ["TRITON_INTERPRET"] = "1"
