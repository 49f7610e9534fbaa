"""The synthetic world: determinism, the entity split, and what answer/distractor passages hold."""

import re

import pytest

from rag_jax.run import synthetic


def _has_word(text, word):
    return re.search(rf"(^| ){re.escape(word)}( |$)", text) is not None


def test_world_is_deterministic_and_sized():
    cfg = synthetic.WorldConfig(seed=3, num_entities=40, distractors_per_fact=2)
    a, b = synthetic.make_world(cfg), synthetic.make_world(cfg)
    assert a == b
    assert a != synthetic.make_world(synthetic.WorldConfig(seed=4, num_entities=40))
    relations = len(synthetic.RELATIONS)
    assert len(a.facts) == 40 * relations
    assert len(a.passages) == 40 * relations * (1 + 2)
    assert len({p.id for p in a.passages}) == len(a.passages)


def test_entities_are_split_and_answers_live_in_one_passage():
    world = synthetic.make_world(synthetic.WorldConfig(num_entities=60))
    train = {f.entity for f in world.facts if f.split == "train"}
    held_out = {f.entity for f in world.facts if f.split == "eval"}
    assert train and held_out and not train & held_out
    assert len(held_out) == 15
    by_id = {p.id: p for p in world.passages}
    for fact in world.facts:
        gold = by_id[fact.gold_id]
        assert _has_word(gold.text, fact.answer)
        about = [p for p in world.passages if p.title == fact.entity]
        # Only the gold passage of this entity states the answer of this relation.
        holders = [p.id for p in about if _has_word(p.text, fact.answer)]
        assert holders == [fact.gold_id]
        distractors = [p for p in about if p.id.startswith(f"{fact.gold_id[: -len('answer')]}")]
        assert len(distractors) == 1 + 3
    qa = world.questions("eval")
    assert len(qa) == 15 * len(synthetic.RELATIONS)
    assert all(q["gold_ids"] and q["answers"] for q in qa)


def test_distractors_overlap_the_question_more_than_the_answer_passage():
    """The property that makes similarity misleading, measured as shared words."""
    world = synthetic.make_world(synthetic.WorldConfig(num_entities=30))
    by_id = {p.id: p for p in world.passages}
    wins = total = 0
    for fact in world.facts:
        q = set(fact.question.split())
        gold = len(q & set(by_id[fact.gold_id].text.split()))
        prefix = fact.gold_id[: -len("answer")]
        for p in world.passages:
            if p.id.startswith(prefix + "distractor"):
                wins += len(q & set(p.text.split())) > gold
                total += 1
    assert wins / total > 0.9


def test_edit_facts_changes_only_the_chosen_answers():
    world = synthetic.make_world(synthetic.WorldConfig(num_entities=20))
    edited_world, edited = synthetic.edit_facts(world, 0.25, seed=1)
    assert len(edited) == 20
    old = {(f.entity, f.relation): f for f in world.facts}
    new_by_id = {p.id: p for p in edited_world.passages}
    old_by_id = {p.id: p for p in world.passages}
    for fact in edited:
        assert fact.answer != old[(fact.entity, fact.relation)].answer
        assert _has_word(new_by_id[fact.gold_id].text, fact.answer)
    changed = {pid for pid in old_by_id if old_by_id[pid] != new_by_id[pid]}
    assert changed == {f.gold_id for f in edited}


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="unknown relations"):
        synthetic.make_world(synthetic.WorldConfig(relations=("age",)))
    with pytest.raises(ValueError, match="distractors_per_fact"):
        synthetic.make_world(synthetic.WorldConfig(distractors_per_fact=4))
    with pytest.raises(ValueError, match="split"):
        synthetic.make_world(synthetic.WorldConfig(num_entities=4)).questions("test")
