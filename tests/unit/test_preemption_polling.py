"""ft_train.collective outside a training function (inside one, on two gloo ranks, in
`tests/test_preemption_polling.py`)."""

from __future__ import annotations

import pytest

import ft_train


def test_the_collectives_outside_a_training_function_say_where_they_work():
    with pytest.raises(ft_train.SessionError, match="inside a training function"):
        ft_train.collective.barrier()
