import pytest

from scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
from tests.scheduler.sched_helpers import small_config


def test_config_defaults_resolve_prefill_budget():
    cfg = SchedulerConfig(num_kv_blocks=300, num_linear_slots=17)
    assert (cfg.block_size, cfg.chunk_stride, cfg.max_num_seqs) == (16, 64, 16)
    assert cfg.max_num_batched_tokens == 2048


@pytest.mark.parametrize("kw, field", [
    (dict(chunk_stride=6), "chunk_stride"),            # not a multiple of block_size 4
    (dict(chunk_stride=0), "chunk_stride"),
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_num_batched_tokens=4), "max_num_batched_tokens"),  # < chunk_stride 8
    (dict(num_kv_blocks=16), "num_kv_blocks"),         # 64 tokens need 16 blocks + padding
    (dict(num_linear_slots=4), "too few linear slots for max_num_seqs"),
])
def test_config_rejects_bad_field_naming_it(kw, field):
    with pytest.raises(ValueError, match=field):
        small_config(**kw)


def test_config_without_gdn_layers_needs_no_slots():
    cfg = small_config(has_linear_attention_layers=False, num_linear_slots=0)
    assert Scheduler(cfg).block_manager.linear is None


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(seed=1.5), "seed"),
])
def test_sampling_params_reject_bad_field_naming_it(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_accept_vllm_conventions():
    sp = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, logprobs=0, stop_token_ids=[3])
    assert sp.is_greedy and sp.stop_token_ids == [3]
    assert SamplingParams(top_k=1, logprobs=20).top_k == 1


@pytest.mark.parametrize("tokens, problem", [([], "empty prompt"), (list(range(65)), "max_model_len")])
def test_add_rejects_bad_prompt_and_leaves_scheduler_unchanged(tokens, problem):
    sched = Scheduler(small_config())
    sched.add(Sequence(1, [1, 2, 3]))
    with pytest.raises(ValueError, match=problem):
        sched.add(Sequence(2, tokens))
    assert [s.seq_id for s in sched.waiting] == [1] and list(sched.seqs) == [1]
    sched.check_invariants()


def test_add_rejects_duplicate_seq_id():
    sched = Scheduler(small_config())
    sched.add(Sequence(1, [1, 2, 3]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Sequence(1, [4]))


def test_prompt_plus_max_tokens_beyond_max_model_len_finishes_with_length():
    sched = Scheduler(small_config())
    seq = Sequence(1, list(range(62)), SamplingParams(max_tokens=10))
    sched.add(seq)
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.postprocess(plan, [0 if r.sample else None for r in plan.seqs])
    assert seq.finish_reason == "length" and len(seq.token_ids) == 64 and seq.output_token_ids == [0, 0]
