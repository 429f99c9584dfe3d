"""The tiny DeepSeek-V3 that context-parallel tests shard (tests/unit/parallel/test_moe_cp.py on CPU,
tests/cuda/test_moe_cp_gpu.py on GPUs): flex attention over a sequence CP can split."""

from __future__ import annotations

from titan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from titan.models.moe import MoEArgs

SEQ, VOCAB = 512, 256  # flex CP needs seq_len % (2 x cp x 128) == 0
CP_MOE = dict(num_experts=4, top_k=2)
# MLA with q/k heads of 8 + 8 features and values of 8 (the kernels take each at its own width; CUDA's
# fused SDPA kernels want multiples of 8), low-rank queries, YaRN on (max_seq_len > original_seq_len),
# sigmoid scores in 2 groups, a shared expert.
DS = DeepSeekV3ModelArgs(
    vocab_size=VOCAB, dim=64, n_layers=2, n_dense_layers=1, n_heads=4, inter_dim=64, moe_inter_dim=32,
    q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, original_seq_len=128,
    rope_factor=4.0, mscale=0.7, max_seq_len=SEQ, attn_type="flex",
    moe_args=MoEArgs(**CP_MOE, num_shared_experts=1, score_before_experts=False, score_func="sigmoid",
                     route_norm=True, route_scale=2.0, num_expert_groups=2, num_limited_groups=1,
                     load_balance_coeff=1e-2),
)  # fmt: skip
