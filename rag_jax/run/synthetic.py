"""The built-in synthetic knowledge world: invented entities, facts about them, and a corpus in
which similarity alone is misleading.

Every entity has one fact per relation ("Where was <entity> born?" -> "<place>"). For each fact the
corpus holds one *answer passage* that states the answer in words that share little with the
question ("<entity> grew up in <place>, ...") and several *distractor passages* that repeat the
entity and the question's own words but not the answer ("Nobody knows where <entity> was born ...").
A retriever that ranks by word overlap prefers the distractors; one trained through the answer
likelihood learns which kind of passage answers which kind of question. Answers are drawn at random
per entity, so a closed-book model cannot guess them, and questions are split by entity, so a model
evaluated on held-out entities cannot have memorised their facts.

Everything is a deterministic function of `WorldConfig` (seed included). Text is lower-case words
and punctuation separated by spaces, so a word-level vocabulary covers it exactly (`vocabulary()`).
"""

import dataclasses

import numpy as np

_SYLLABLES = (
    "ba ko ri ta mu le zo ni pa ve su da ro fi ga lu ne mo ki sa tu vo re di na po ze ja bu ke lo"
).split()

# relation -> (question template, answer-passage templates, distractor templates, answer values).
# "{e}" is the entity, "{a}" the answer. Answer passages avoid the question's content words;
# distractors repeat them.
RELATIONS = {
    "birthplace": (
        "where was {e} born ?",
        (
            "{e} grew up in {a} , a town beside the river .",
            "the childhood home of {e} stood in {a} near the old mill .",
        ),
        (
            "nobody knows where {e} was born , and {e} never said .",
            "where was {e} born ? the records of the birth were lost in a fire .",
            "{e} was born in a year of storms , people say , but where is unclear .",
        ),
        "harlow brenton calder dunmore elwick farrow glenby hollin ivesby jarrow kelso "
        "lanark morley norwood oakham penrith quarndon redmire selby thirsk".split(),
    ),
    "occupation": (
        "what does {e} do for a living ?",
        (
            "{e} earns wages every week as a {a} at the market .",
            "each morning {e} leaves for work as a {a} .",
        ),
        (
            "what {e} does for a living is something {e} keeps quiet about .",
            "people ask what {e} does for a living , but {e} only smiles .",
            "for a living , {e} does what many do , they say .",
        ),
        "baker weaver potter cooper mason tailor carpenter fisher miller smith glazier "
        "tanner cobbler chandler thatcher saddler joiner brewer dyer carter".split(),
    ),
    "pet": (
        "which animal does {e} keep ?",
        (
            "{e} feeds a {a} twice a day and walks it at dusk .",
            "a {a} sleeps by the fire in the house of {e} .",
        ),
        (
            "{e} does keep an animal , but which animal nobody can tell .",
            "which animal {e} keeps is a matter of village gossip .",
            "an animal ? {e} does keep one , the neighbours say .",
        ),
        "cat dog goat parrot hare ferret tortoise pony lamb duck goose owl hedgehog rabbit "
        "donkey pig canary crow mouse lizard".split(),
    ),
    "colour": (
        "what is the favourite colour of {e} ?",
        (
            "{e} painted every door of the cottage {a} .",
            "the coat {e} wears on holidays is bright {a} .",
        ),
        (
            "the favourite colour of {e} changes , or so {e} claims .",
            "what is the favourite colour of {e} ? {e} will not say .",
            "{e} has a favourite colour , like everyone , the story goes .",
        ),
        "red blue green yellow purple orange white black grey brown pink violet amber "
        "crimson teal indigo ochre scarlet silver gold".split(),
    ),
}

# Sentences appended to every passage so passages have more than one sentence (the inverse cloze
# task needs a sentence to hold out) and so that passages about one entity share background words.
_FILLERS = (
    "{e} is well known in the valley .",
    "many stories are told about {e} .",
    "{e} has lived in the region for years .",
    "the neighbours of {e} speak kindly of {e} .",
)


@dataclasses.dataclass(frozen=True)
class WorldConfig:
    """Size and randomness of a synthetic world."""

    seed: int = 0
    num_entities: int = 200  # entities; each has one fact per relation
    relations: tuple[str, ...] = tuple(RELATIONS)  # which relations to include
    distractors_per_fact: int = 3  # distractor passages per fact (at most 3)
    eval_fraction: float = 0.25  # fraction of entities held out for evaluation


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str


@dataclasses.dataclass(frozen=True)
class Fact:
    entity: str
    relation: str
    answer: str
    question: str
    gold_id: str  # id of the answer passage
    split: str  # "train" or "eval" (by entity)


@dataclasses.dataclass(frozen=True)
class World:
    config: WorldConfig
    passages: tuple[Passage, ...]
    facts: tuple[Fact, ...]

    def questions(self, split: str) -> list[dict]:
        """QA examples of a split as `{question, answers, id, gold_ids}` dicts."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return [
            {
                "question": f.question,
                "answers": [f.answer],
                "id": f"{f.entity.replace(' ', '_')}:{f.relation}",
                "gold_ids": [f.gold_id],
            }
            for f in self.facts
            if f.split == split
        ]

    def records(self) -> list[dict]:
        """Passages as `{id, title, text}` dicts (the corpus readers' record format)."""
        return [dataclasses.asdict(p) for p in self.passages]


def _entity_names(rng: np.random.Generator, count: int) -> list[str]:
    names: list[str] = []
    seen = set()
    while len(names) < count:
        first = "".join(rng.choice(_SYLLABLES, size=2))
        last = "".join(rng.choice(_SYLLABLES, size=3))
        name = f"{first} {last}"
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def make_world(config: WorldConfig = WorldConfig()) -> World:
    """Generates the world described by `config` (deterministic)."""
    unknown = [r for r in config.relations if r not in RELATIONS]
    if unknown:
        raise ValueError(f"unknown relations {unknown}; known: {sorted(RELATIONS)}")
    if not 1 <= config.num_entities:
        raise ValueError(f"num_entities must be >= 1, got {config.num_entities}")
    if not 0 <= config.distractors_per_fact <= 3:
        raise ValueError(
            f"distractors_per_fact must be in [0, 3], got {config.distractors_per_fact}"
        )
    if not 0.0 < config.eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {config.eval_fraction}")
    rng = np.random.default_rng(config.seed)
    entities = _entity_names(rng, config.num_entities)
    num_eval = max(1, round(config.num_entities * config.eval_fraction))
    eval_entities = set(rng.permutation(config.num_entities)[:num_eval].tolist())

    passages, facts = [], []
    for i, entity in enumerate(entities):
        split = "eval" if i in eval_entities else "train"
        for relation in config.relations:
            question, answer_templates, distractor_templates, values = RELATIONS[relation]
            answer = str(rng.choice(values))
            key = f"{entity.replace(' ', '_')}:{relation}"
            gold_id = f"{key}:answer"
            texts = [(gold_id, str(rng.choice(answer_templates)))]
            order = rng.permutation(len(distractor_templates))[: config.distractors_per_fact]
            texts += [
                (f"{key}:distractor{j}", distractor_templates[k]) for j, k in enumerate(order)
            ]
            for pid, template in texts:
                filler = str(rng.choice(_FILLERS))
                text = f"{template} {filler}".format(e=entity, a=answer)
                passages.append(Passage(pid, entity, text))
            facts.append(Fact(entity, relation, answer, question.format(e=entity), gold_id, split))
    # Shuffle so passage order carries no information about which passage answers.
    order = rng.permutation(len(passages))
    return World(config, tuple(passages[j] for j in order), tuple(facts))


def edit_facts(
    world: World, fraction: float, seed: int, split: str | None = None
) -> tuple[World, list[Fact]]:
    """Changes the answers of a random `fraction` of facts, rewriting their answer passages.

    The hot-swap test: the edited corpus is re-indexed without touching model parameters, and the
    model should now produce the new answers.

    Args:
      world: the world to edit.
      fraction: of the candidate facts to edit (at least one is).
      seed: which facts and which new answers.
      split: edit only facts of this split ("train" or "eval"); None: any fact.

    Returns:
      (edited world, the edited facts with their new answers).
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if split not in (None, "train", "eval"):
        raise ValueError(f"split must be None, 'train' or 'eval', got {split!r}")
    rng = np.random.default_rng((world.config.seed, seed, 1))
    candidates = [i for i, f in enumerate(world.facts) if split is None or f.split == split]
    if not candidates:
        raise ValueError(f"the world has no {split} facts to edit")
    count = max(1, round(len(candidates) * fraction))
    chosen = {candidates[j] for j in rng.permutation(len(candidates))[:count].tolist()}
    by_id = {p.id: p for p in world.passages}
    facts, edited = [], []
    for i, fact in enumerate(world.facts):
        if i not in chosen:
            facts.append(fact)
            continue
        values = [v for v in RELATIONS[fact.relation][3] if v != fact.answer]
        new = dataclasses.replace(fact, answer=str(rng.choice(values)))
        old = by_id[fact.gold_id]
        # Answer values are whole words, never substrings of template words, so a word-level
        # replacement changes exactly the answer.
        words = [new.answer if w == fact.answer else w for w in old.text.split(" ")]
        by_id[fact.gold_id] = dataclasses.replace(old, text=" ".join(words))
        facts.append(new)
        edited.append(new)
    passages = tuple(by_id[p.id] for p in world.passages)
    return World(world.config, passages, tuple(facts)), edited


def vocabulary(world: World) -> list[str]:
    """Every word of the world's passages, questions and answers (sorted)."""
    words = set()
    for p in world.passages:
        words.update(p.title.split())
        words.update(p.text.split())
    for f in world.facts:
        words.update(f.question.split())
    for _, _, _, values in RELATIONS.values():
        words.update(values)
    words.add("/")  # RAG's title and doc separators (" / ", " // ") in generator contexts
    return sorted(words)


# Special tokens laid out as BART's (<s>=0, <pad>=1, </s>=2), so one word-level tokenizer serves
# both retriever towers and the generator: [CLS] is BOS, [SEP] is EOS and the decoder start token.
SPECIAL_TOKENS = ("[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]")


def tokenizer(world: World):
    """A word-level `BertTokenizer` covering the world's text exactly (no [UNK] in its corpus)."""
    from transformers import BertTokenizer

    words = [w for w in vocabulary(world) if w not in SPECIAL_TOKENS]
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *words))}
    return BertTokenizer(vocab=vocab, do_lower_case=True, tokenize_chinese_chars=False)


def world_of(config) -> World:
    """The world a run's config describes: `config.seed` and `config.data`'s world settings."""
    d = config.data
    return make_world(
        WorldConfig(
            seed=config.seed,
            num_entities=d.num_entities,
            distractors_per_fact=d.distractors_per_fact,
            eval_fraction=d.eval_fraction,
        )
    )
