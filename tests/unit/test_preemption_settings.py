"""FailureConfig's preemption settings with Ray's meaning, and the agreement's flags."""

import pydantic
import pytest

import ft_train
from ft_train.config import parse
from ft_train.protocol import Point, PreemptionInfo, decode_flags, encode_flags


def test_the_notice_is_preemption_notice_s_and_preemption_grace_s_is_rays():
    config = ft_train.FailureConfig(preemption_notice_s=60)
    assert (config.preemption_notice_s, config.preemption_grace_s) == (60, 0)
    assert ft_train.FailureConfig().preemption_notice_s == 30
    assert ft_train.FailureConfig(preemption_grace_s=0).preemption_grace_s == 0  # Ray's default


@pytest.mark.parametrize("grace_s", [30, 0.5])
def test_a_nonzero_preemption_grace_s_is_refused_naming_the_difference_and_the_new_name(grace_s):
    with pytest.raises(pydantic.ValidationError, match="preemption_notice_s"):
        ft_train.FailureConfig(preemption_grace_s=grace_s)
    # a deployment's stored parameters with ft-train's old name: the same message
    stored = {"name": "nightly", "failure_config": {"preemption_grace_s": grace_s}}
    with pytest.raises(ft_train.ConfigError) as refused:
        parse(ft_train.RunConfig, stored, "run_config")
    message = str(refused.value)
    assert "run_config.failure_config.preemption_grace_s" in message
    assert "past a preemption's deadline" in message  # Ray's meaning
    assert "now failure_config.preemption_notice_s" in message  # where the old meaning went


@pytest.mark.parametrize(
    "name, value, alternative",
    [
        ("relax_collectives_on_preemption", True, "get_preemption_info"),
        ("relax_collectives_on_preemption", False, "get_preemption_info"),
        ("controller_failure_limit", -1, "worker_start_timeout_s"),
    ],
)
def test_rays_other_preemption_settings_are_refused_by_name(name, value, alternative):
    # one table of Ray's names that ft-train does not offer (`ft_train.ray_names`)
    with pytest.raises(ft_train.ConfigError, match=f"FailureConfig.{name} is Ray Train's") as e:
        parse(ft_train.RunConfig, {"name": "r", "failure_config": {name: value}}, "run_config")
    assert alternative in str(e.value)
    with pytest.raises(ft_train.ConfigError, match=name):
        ft_train.FailureConfig(**{name: value})


def test_preemption_info_answers_to_rays_names_too():
    info = PreemptionInfo((3, 1), 1700000000.25)
    assert (info.preempted_ranks, info.deadline_ms) == ([1, 3], 1700000000250)
    assert info.reported is False


def _reduced(*ranks_flags: list[float]) -> list[float]:
    return [max(column) for column in zip(*ranks_flags)]


def test_the_flags_tell_whether_every_rank_is_at_the_same_point():
    def flags(rank, index=5, kind=Point.POLL, reports=2, payload=0):
        return encode_flags(rank, 2, None, False, False, 1, index, kind, reports, payload)

    assert decode_flags(_reduced(flags(0), flags(1)), 2).same_index
    for other in ({"index": 6}, {"kind": Point.REPORT}, {"reports": 3}):
        assert not decode_flags(_reduced(flags(0), flags(1, **other)), 2).same_index, other
    agreed = decode_flags(_reduced(flags(0, payload=101), flags(1)), 2)
    assert agreed.payload == 101  # rank 0's broadcast size, plus one


def test_the_collectives_on_a_session_without_a_group_return_at_once(tmp_path):
    from ft_train.storage.fs import Storage
    from tests.rank_specs import installed, rank_spec

    spec = rank_spec(Storage(str(tmp_path)), attempt_id="a" * 32)
    with installed(spec):
        ft_train.collective.barrier()
        data = {"lr": 0.1}
        assert ft_train.collective.broadcast_from_rank_zero(data) is data
        assert ft_train.get_preemption_info() is None
