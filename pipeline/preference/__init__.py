"""Offline preference optimisation (DPO-family) on (prompt, chosen, rejected) pairs.

Shape vocabulary, used in every shape comment of this package (the ppo package's, plus N):

    N  number of preference pairs (KTO: unpaired examples) in a batch
    B  rows of one forward: 2N when chosen and rejected go through the model together
    P  prompt length (left-padded prompts), R response length (right-padded responses)
    V  vocabulary size

Every loss works on per-sequence log-probabilities: the sum over the response tokens of
log pi(y_t | x, y_<t), (N,) per side, never per-token tensors.
"""
