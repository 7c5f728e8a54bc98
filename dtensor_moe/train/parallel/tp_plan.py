"""The main job's dense TP plan as plain data (torch-free: `dtensor-moe explain` prints it)."""

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
TP_ROOT_PLAN = (("tok_embeddings", "embedding"), ("norm", "sequence"), ("output", "head"))
TP_BLOCK_PLAN = (
    ("attention_norm", "sequence"),
    ("attention", "gather_seq"),
    ("attention.wq", "colwise"),
    ("attention.wk", "colwise"),
    ("attention.wv", "colwise"),
    ("attention.wo", "rowwise"),
    ("ffn_norm", "sequence_local"),
)
