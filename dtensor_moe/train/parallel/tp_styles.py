"""The main job's dense TP styles (module path -> style) as plain data, and its checks of the model config
(torch-free: `dtensor-moe explain` prints them, and train/config.py checks a config before torch is imported)."""

# Dense tensor parallelism with sequence parallelism for the main job's model (torchtitan's apply_tp):
# (module path, style) pairs, applied by tensor_parallel.py. Between blocks the activations are
# sequence-sharded over tp; attention gathers the sequence and splits the heads; the MoE takes its own
# sequence slice as it is. Styles:
#   embedding      rows (vocab) sharded, replicated token ids in, sequence-sharded out
#   sequence       weights replicated, runs on the local sequence slice (norms)
#   sequence_local the same, handing a plain tensor on (the MoE takes local tokens)
#   gather_seq     all-gathers the sequence at the module's input
#   colwise        output features sharded (whole heads: n_heads % tp == 0)
#   rowwise        input features sharded, output reduce-scattered back to sequence slices
#   head           output features sharded, sequence-sharded in, logits replicated out
TP_ROOT_STYLES = (("tok_embeddings", "embedding"), ("norm", "sequence"), ("output", "head"))
TP_BLOCK_STYLES = (
    ("attention_norm", "sequence"),
    ("attention", "gather_seq"),
    ("attention.wq", "colwise"),
    ("attention.wk", "colwise"),
    ("attention.wv", "colwise"),
    ("attention.wo", "rowwise"),
    ("ffn_norm", "sequence_local"),
)


# The TP styles' needs from the model config, shared by train/config.py's Config (which names the
# field parallel.tp: prefix "parallel.") and tensor_parallel.check_tp_model (the tp argument: prefix "").
def check_tp_heads(n_heads: int, tp: int, prefix: str = "") -> None:
    if n_heads % tp:
        raise ValueError(f"model.n_heads ({n_heads}) must be divisible by {prefix}tp ({tp}) so each TP rank owns whole "
                         f"heads; valid tp: {[d for d in range(1, n_heads + 1) if n_heads % d == 0]}")


def check_tp_untied(tie_embeddings: bool, tp: int, prefix: str = "") -> None:
    if tp > 1 and tie_embeddings:
        raise ValueError(f"{prefix}tp={tp} needs model.tie_embeddings = false (the embedding is sharded by vocabulary "
                         f"rows, the head by output features); valid: model.tie_embeddings = false, or {prefix}tp = 1")
