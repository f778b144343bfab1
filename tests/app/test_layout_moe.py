"""A layout search for a mixture-of-experts model on a GPU preset: every layout is profiled on fake
tensors, where Hugging Face's experts run a grouped matrix product torch's meta kernel refused in
float32; the search ranked no layout of an HF Mixtral (tests/memory/test_moe_fake_profile.py)."""

from support.layout_configs import compose_train

from pipeckpt import plan_layout

MIXTRAL = (
    "model.config={model_type:mixtral,hidden_size:64,intermediate_size:128,num_hidden_layers:4,"
    "num_attention_heads:4,num_key_value_heads:2,vocab_size:256,num_local_experts:4,"
    "num_experts_per_tok:2,max_position_embeddings:64}"
)


def test_an_hf_mixtrals_layouts_are_ranked_on_a_gpu_preset():
    overrides = ["model=hf", MIXTRAL, "model.seq_len=32", "data.batch_size=8", "strategy.engine=distributed"]
    overrides += ["trainer.devices=2", "strategy.layout=auto", "cluster=h100_8"]
    answer = plan_layout.search_config(compose_train(overrides))
    ranked = answer.searched.ranked
    assert {(r.candidate.pp, r.candidate.tp) for r in ranked} == {(1, 1), (1, 2), (2, 1)}
    assert all(r.candidate.modes and r.estimate.step_s > 0 for r in ranked)
