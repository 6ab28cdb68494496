"""The synthetic long-context tasks: answers read off the prompt by hand, rewards by exact match."""

import pytest
import torch

from longstraw.training import tasks


def test_kv_retrieval_hides_needles_at_the_asked_depths_and_asks_for_one():
    task = tasks.build_task(
        {"name": "kv_retrieval", "length": 400, "num_needles": 3, "value_length": 2, "depths": [0.1, 0.5, 0.9]},
        vocab_size=1000,
    )
    ex = task.make(seed=7)
    ids = ex.prompt_ids.tolist()
    assert len(ids) == 400 and ids[-3] == tasks.QUERY and ids[-1] == tasks.ANSWER
    key_positions = [i for i, t in enumerate(ids[:-3]) if t == tasks.KEY]
    assert len(key_positions) == 3
    assert [round(p / 400, 1) for p in key_positions] == [0.1, 0.5, 0.9]
    # find the queried key's needle by hand and read its value
    queried = ids[-2]
    at = next(p for p in key_positions if ids[p + 1] == queried)
    assert ids[at + 2] == tasks.VAL and ids[at + 5] == tasks.END
    assert ex.answer == tuple(ids[at + 3 : at + 5])
    assert task.reward(ex, torch.tensor([*ex.answer, 5])) == 1.0
    assert task.reward(ex, torch.tensor([ex.answer[0], 0])) == 0.0
    assert (
        tasks.build_task(
            {"name": "kv_retrieval", "length": 400, "value_length": 2, "partial": True}, vocab_size=1000
        ).reward(ex, torch.tensor([ex.answer[0], 0]))
        == 0.5
    )


def test_counting_answer_is_the_number_of_markers():
    task = tasks.build_task({"name": "counting", "length": 300, "min_count": 2, "max_count": 9}, vocab_size=500)
    for seed in range(5):
        ex = task.make(seed)
        n = (ex.prompt_ids[:-2] == tasks.MARK).sum().item()
        assert 2 <= n <= 9 and ex.answer == (tasks.NUMBER + n,)
        assert task.reward(ex, torch.tensor([tasks.NUMBER + n])) == 1.0
        assert task.reward(ex, torch.tensor([tasks.NUMBER + n + 1])) == 0.0


def test_examples_are_seeded():
    task = tasks.build_task({"name": "kv_retrieval", "length": 200}, vocab_size=300)
    assert torch.equal(task.make(3).prompt_ids, task.make(3).prompt_ids)
    assert not torch.equal(task.make(3).prompt_ids, task.make(4).prompt_ids)


def test_plugins_and_bad_specs():
    tasks.register_task("constant", lambda vocab_size, answer=5: tasks.Counting(vocab_size, length=50))
    assert isinstance(tasks.build_task({"name": "constant"}, vocab_size=300), tasks.Counting)
    assert isinstance(
        tasks.build_task({"plugin": "longstraw.training.tasks:Counting", "length": 50}, vocab_size=300), tasks.Counting
    )
    with pytest.raises(ValueError, match="unknown task"):
        tasks.build_task({"name": "needle"}, vocab_size=300)
    with pytest.raises(ValueError, match="too small"):
        tasks.build_task({"name": "kv_retrieval"}, vocab_size=60)
    with pytest.raises(ValueError, match="depths"):
        tasks.build_task({"name": "kv_retrieval", "depths": [2.0]}, vocab_size=300)
