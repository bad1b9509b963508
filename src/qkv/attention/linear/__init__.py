"""Linear attention: the softmax kernel exp(q^T k) replaced by a product of feature maps.

    out_i = phi(q_i)^T S / phi(q_i)^T z,   S = sum_j phi(k_j) v_j^T,   z = sum_j phi(k_j)
                                                        (Katharopoulos et al. 2020, s3.2)

Associativity replaces the (L_q, L_k) score matrix by a (F, D_v) state S and an (F,) normaliser z,
F features per head: O(L) time and memory. Causal attention reads prefix sums of S and z, over
keys j <= i + L_k - L_q (aligned bottom-right, as `qkv.masks.causal`, s3.3); one token at a time
that is a recurrent network with state (S, z) (s3.4), which `linear_attention_step` runs.

Read bottom-up: `features` (elu(x) + 1, and FAVOR+'s positive orthogonal random features,
Choromanski et al. 2021, with their stabilisation), `parallel` (`linear_attention` and the
chunked causal autograd Function), `recurrent` (the state and the one-token step), `module`
(`LinearAttention`, the nn.Module).
"""

from qkv.attention.linear.features import (
    FavorFeatureMap,
    elu_feature_map,
    orthogonal_random_features,
)
from qkv.attention.linear.module import LinearAttention
from qkv.attention.linear.parallel import linear_attention
from qkv.attention.linear.recurrent import (
    LinearAttentionState,
    linear_attention_state,
    linear_attention_step,
)

__all__ = [
    "FavorFeatureMap",
    "LinearAttention",
    "LinearAttentionState",
    "elu_feature_map",
    "linear_attention",
    "linear_attention_state",
    "linear_attention_step",
    "orthogonal_random_features",
]
