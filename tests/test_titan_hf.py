"""Hugging Face checkpoints through the torchtitan hook (issue 16 item 6), 4 CPU gloo ranks, EP=2 x ETP=2.

A tiny Qwen3-MoE, a tiny DeepSeek-V3 (4 groups of 2 experts, 2 groups kept, shared expert,
random e_score_correction_bias, YaRN) and a tiny gpt-oss (random biases and sinks, sliding windows,
YaRN) are written by transformers' save_pretrained, in the architecture of our torchtitan configs
`qwen3_moe_tiny_cpu`, `deepseek_v3_hf_cpu` and `gpt_oss_tiny_cpu`. torchtitan loads them with its
state-dict adapter (gpt-oss: the hook's GptOssHFAdapter) (`--checkpoint.initial_load_in_hf`: to_hf on
the sharded model, DCP's HuggingFaceStorageReader, from_hf) under `--module dtensor_moe.titan`:
- the keys the adapter asks for, over all ranks, are exactly the checkpoint's (so every tensor,
  the correction bias included, is loaded: our hook keeps torchtitan's names), and each rank asks
  only for its own EP rank's experts (a sharded read, no rank loads every expert; gpt-oss's expert
  tensors hold a whole layer: each rank asks for its EP x ETP slice);
- the first forward's logits equal transformers' on the same tokens (float32);
- two training steps run from the loaded weights and the loss falls.

Tolerance: max |logits - logits_hf| < LOGITS_ATOL for logits up to ~0.7. torchtitan's grouped experts
compute in bfloat16 whatever the parameter dtype; measured 3.3e-4 (Qwen3), 7.4e-4 (DeepSeek-V3) and
1.55e-3 (gpt-oss, whose experts also round their output rows, biases included, to bfloat16). Rounding
only the transformers model's expert weights to bf16 moves its logits by 1.8e-4 / 4.3e-4 / 7.0e-4;
a wrong expert mapping (experts in reverse order) by 0.1 / 0.2 / 0.44.
"""

import os

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")

import torch  # noqa: E402

from .harness import run_on_ranks  # noqa: E402

WORLD = 4
EP = ETP = 2
STEPS = 2
VOCAB = 384  # config_registry.TINY_VOCAB
LOGITS_ATOL = 2e-3


def _hf_config(model_type: str):
    """The transformers config of the same architecture as our torchtitan config for it."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if model_type == "gpt_oss":  # gpt_oss_tiny_cpu: sliding windows of 8 on even layers, YaRN without truncation
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 256}
        return tf.GptOssConfig(**{**common, "rms_norm_eps": 1e-5, "max_position_embeddings": 256 * 32},
                               num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                               num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"], rope_parameters=yarn)
    if model_type == "qwen3_moe":  # qwen3_moe_tiny_cpu
        return tf.Qwen3MoeConfig(**common, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                 moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 0.7, "mscale_all_dim": 0.7, "original_max_position_embeddings": 256}
    return tf.DeepseekV3Config(**common, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=128,
                               moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                               topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                               first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
                               qk_nope_head_dim=16, v_head_dim=16, rope_parameters=yarn)


def _write_checkpoint(model_type: str, path, tokens):
    """save_pretrained of a random model; returns its logits on tokens and the checkpoint's keys."""
    import transformers as tf
    from safetensors import safe_open

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_hf_config(model_type), experts_implementation="eager").eval()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # decisive routing: no near-ties to flip
                t.normal_(std=0.5)
            elif name.endswith(("bias", "sinks")):  # transformers zeroes most (e_score_correction_bias too)
                t.normal_(std=0.1)
        logits = model(tokens).logits
    model.save_pretrained(path)
    keys = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            keys |= set(sf.keys())
    return logits, keys


def _load_and_train(rank: int, world: int, argv: list[str], tokens) -> dict:
    """torchtitan's Trainer with argv: the HF keys this rank's adapter requests, the logits of the
    loaded model on tokens, then the losses of the training steps."""
    os.environ["LOCAL_RANK"] = str(rank)
    from dtensor_moe.titan.cpu import use_cpu

    use_cpu()
    from torchtitan.config import ConfigManager

    trainer = ConfigManager().parse_args(argv).build()
    losses, log = [], trainer.metrics_processor.log

    def capture_log(step, loss, max_loss, grad_norm, **kwargs):
        losses.append(loss)
        return log(step, loss, max_loss, grad_norm, **kwargs)

    trainer.metrics_processor.log = capture_log
    try:
        model = trainer.model_parts[0]
        hf = trainer.checkpointer.sd_adapter.to_hf(model.state_dict())
        keys = set(hf)
        local = {k: tuple(v.to_local().shape) for k, v in hf.items() if ".mlp.experts." in k}
        trainer.checkpointer.load()
        with torch.no_grad():
            logits = model(tokens)
            if model._skip_lm_head:  # set for torchtitan's chunked loss, which applies lm_head itself
                logits = model.lm_head(logits)
        trainer.train()
    finally:
        trainer.close()
    return {"keys": keys, "local": local, "logits": logits, "losses": losses}


@pytest.mark.parametrize("model_type, config", [("qwen3_moe", "qwen3_moe_tiny_cpu"),
                                                ("deepseek_v3", "deepseek_v3_hf_cpu"), ("gpt_oss", "gpt_oss_tiny_cpu")])
def test_hf_checkpoint_loads_through_titan_adapters(tmp_path, model_type, config):
    tokens = torch.randint(0, 382, (2, 32), generator=torch.Generator().manual_seed(0))
    logits_hf, hf_keys = _write_checkpoint(model_type, tmp_path / "hf", tokens)
    argv = ["--module", "dtensor_moe.titan", "--config", config, "--dump_folder", str(tmp_path / "run"),
            "--dtensor_moe.ep", str(EP), "--dtensor_moe.etp", str(ETP), "--training.steps", str(STEPS),
            "--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
            "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_model_only"]
    ranks = run_on_ranks(WORLD, _load_and_train, argv, tokens)

    assert set().union(*(r["keys"] for r in ranks)) == hf_keys
    if model_type == "gpt_oss":  # whole-layer expert tensors: each rank's slice is its 4 experts' F / ETP
        assert ranks[0]["local"]["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 2 * 32 // ETP)
        assert ranks[0]["local"]["model.layers.0.mlp.experts.down_proj"] == (4, 32 // ETP, 64)
    else:
        experts = [{k for k in r["keys"] if ".mlp.experts." in k} for r in ranks]
        for rank, own in enumerate(experts):  # EP outer, ETP inner: ranks 0, 1 hold experts 0-3
            ids = {int(k.split(".mlp.experts.")[1].split(".")[0]) for k in own}
            assert ids == set(range(4 * (rank // ETP), 4 * (rank // ETP) + 4)), (rank, sorted(ids))
    errs = [(r["logits"] - logits_hf).abs().max().item() for r in ranks]
    print(f"{model_type}: max |logits - logits_hf| {max(errs):.2e} (logits up to {logits_hf.abs().max():.2f}); "
          f"losses {ranks[0]['losses']}")
    assert max(errs) < LOGITS_ATOL, errs
    losses = ranks[0]["losses"]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
