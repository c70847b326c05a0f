"""PPO stage of the RLHF pipeline (InstructGPT: SFT -> RM -> PPO).

Shape vocabulary, used in every shape comment of this package:

    B  batch: number of prompt/response pairs in a rollout, minibatch or micro-batch
    P  prompt length (left-padded prompts)
    R  response length (right-padded responses)
    T  = P + R, length of the full prompt + response sequence
    V  vocabulary size

Per-token tensors on the response axis are (B, R) and travel with one mask,
``response_mask`` (B, R) bool, True on real response tokens. Per-sequence
tensors such as ``scores`` are (B,).
"""

# The advantage estimators, loss reductions and KL estimators register themselves where they are
# defined (pipeline/registries.py); importing any module of this package registers them, so a
# config's `uses_critic` (which reads the estimator's facts) holds wherever the package is used.
from . import advantages, group_advantages  # noqa: E402,F401
