"""One model timed at two decoder depths: the time per decoder layer, the fixed rest of the step, and a projection
to the model's real depth.

On one GPU a model cut to a few layers spends much of its step outside them (the embedding, the LM head and loss,
AdamW over every weight): a slice's own tokens/s understates what the layers do. The difference of two depths
cancels that fixed part: per_layer = (t2 - t1) / (d2 - d1), fixed = t1 - d1 * per_layer, and at the real depth
t = fixed + real_depth * per_layer. FLOPs per token extrapolate the same way, so the projected MFU is the real
model's FLOPs over the projected time (the fixed part is still one GPU's: the LM head and AdamW weigh more there
than on an EP rank of the real run).
"""


def project(tokens: int, depths: tuple[int, int], tokens_per_s: tuple[float, float],
            flops_per_token: tuple[float, float] | None, real_depth: int, peak_flops: float | None) -> dict:
    """The per-layer and fixed times of one row measured at two depths, and its tokens/s and MFU at `real_depth`.

    Args:
        tokens (int): tokens a step (batch * sequence length).
        depths (tuple[int, int]): the two decoder depths, different.
        tokens_per_s (tuple[float, float]): the row's tokens/s at each.
        flops_per_token (tuple[float, float] | None): its model FLOPs per token at each; None: no MFU.
        real_depth (int): the model's own depth.
        peak_flops (float | None): the GPU's peak FLOP/s the MFU is taken against; None: no MFU.

    Returns:
        dict: per_layer_ms, fixed_ms, real_depth, projected_tokens_per_s, projected_mfu (a fraction, or None).

    Example:
        >>> p = project(1000, (2, 4), (1000 / 0.3, 1000 / 0.5), None, 10, None)
        >>> round(p["per_layer_ms"], 6), round(p["fixed_ms"], 6), round(p["projected_tokens_per_s"], 3)
        (100.0, 100.0, 909.091)
    """
    (d1, d2), (a, b) = depths, tokens_per_s
    if d1 == d2:
        raise ValueError(f"project: the two depths must differ, got {depths}")
    t1, t2 = tokens / a, tokens / b
    per_layer = (t2 - t1) / (d2 - d1)
    fixed = t1 - d1 * per_layer
    t_real = fixed + real_depth * per_layer
    projected_mfu = None
    if flops_per_token is not None and peak_flops:
        f1, f2 = flops_per_token
        f_real = f1 + (real_depth - d1) * (f2 - f1) / (d2 - d1)
        projected_mfu = f_real * tokens / t_real / peak_flops
    return dict(per_layer_ms=1e3 * per_layer, fixed_ms=1e3 * fixed, real_depth=real_depth,
                projected_tokens_per_s=tokens / t_real, projected_mfu=projected_mfu)
