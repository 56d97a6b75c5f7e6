"""Gemma-3 (text): Gemma-2 plus per-head (1 + w) RMSNorm on queries and keys, and separate rotary
parameters for local (sliding) and global layers (`rope_parameters[layer_type]`, or the older
`rope_local_base_freq` + `rope_scaling`); 5 local : 1 global by default (`sliding_window_pattern`,
read with the layers into the `ModelSpec`). Softcaps are usually off.
"""

from __future__ import annotations

from hybrid_cache.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    QK_NORM = True
