"""QA examples by article: held-out splits and samples of whole articles.

Questions about one article share its facts and phrasing, so a split or a sample by question
would put an article on both sides; these keep articles whole, the article of an example being
the title of its gold passage (SQuAD's `gold_passage_id`).
"""

from collections.abc import Mapping, Sequence

import numpy as np

from rag_jax.run.data import Example


def articles_of(examples: Sequence[Example], titles: Mapping[str, str]) -> dict[str, str]:
    """Example id -> the title (article) of its gold passage; an example without one, or with
    gold passages of several articles or outside the corpus, is refused by its id."""
    article = {}
    for e in examples:
        if not e.gold_ids:
            raise ValueError(
                f"example {e.id!r} has no gold passage id; splitting by article needs one"
            )
        missing = [g for g in e.gold_ids if g not in titles]
        if missing:
            raise ValueError(f"example {e.id!r}: gold passage {missing[0]!r} is not in the corpus")
        found = {titles[g] for g in e.gold_ids}
        if len(found) != 1:
            raise ValueError(f"example {e.id!r}: gold passages from several articles {found}")
        article[e.id] = found.pop()
    return article


def sample_articles(
    examples: Sequence[Example], titles: Mapping[str, str], count: int, seed: int
) -> list[Example]:
    """`count` examples drawn by article: whole articles in a seeded order, the last one cut
    to make `count`, kept in file order. The draws of one seed are nested (the sample of n is
    part of any larger one's), so a learning curve over training-set sizes adds questions
    without changing the ones before.

    Args:
      examples: examples with gold passage ids, in file order.
      titles: passage id -> title, for every gold id.
      count: how many; all of them when it is 0 or at least their number.
      seed: the sample's seed (`data.sample_seed`).
    """
    if not count or count >= len(examples):
        return list(examples)
    chosen: list[int] = []
    for rows in _seeded_articles(examples, titles, seed):
        chosen += rows[: count - len(chosen)]
        if len(chosen) == count:
            break
    return [examples[i] for i in sorted(chosen)]


def _seeded_articles(examples, titles, seed: int) -> list[list[int]]:
    """The examples' rows grouped by article, the articles in the seeded order both the sample
    and the articles after it follow."""
    article = articles_of(examples, titles)
    names = sorted(set(article.values()))
    by_name: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        by_name.setdefault(article[e.id], []).append(i)
    return [by_name[names[j]] for j in np.random.default_rng(seed).permutation(len(names))]


def next_articles(
    examples: Sequence[Example], titles: Mapping[str, str], taken: int, count: int, seed: int
) -> list[Example]:
    """`count` examples of the articles that follow `sample_articles(examples, titles, taken,
    seed)` in the same seeded order, none of them an article of that sample (the article it cut
    is skipped whole), the last one cut to make `count`; kept in file order. A slice of the
    training file no training question of that sample shares an article with: where a study
    chooses its settings without looking at its evaluation questions.

    Raises:
      ValueError: fewer than `count` examples lie outside the sample's articles.
    """
    seen, chosen = 0, []
    for rows in _seeded_articles(examples, titles, seed):
        if seen < taken:  # an article of the sample (the one it cut included)
            seen += len(rows)
            continue
        chosen += rows[: count - len(chosen)]
        if len(chosen) == count:
            return [examples[i] for i in sorted(chosen)]
    raise ValueError(
        f"only {len(chosen)} examples lie outside the articles of a {taken}-example sample; "
        f"{count} were asked for"
    )


def split_by_title(
    examples: Sequence[Example], titles: Mapping[str, str], eval_fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """Splits QA examples by the title (article) of their gold passage: no article in both.

    Questions about one article share its facts and phrasing, so a random question split would
    leak them into evaluation; holding out whole articles tests reading what was never trained on.
    Articles are held out with `np.random.default_rng(seed)`, a fixed function of the seed.

    Args:
      examples: examples with gold passage ids (SQuAD's `gold_passage_id`), in file order.
      titles: passage id -> title, for every gold id.
      eval_fraction: the fraction of articles held out, in (0, 1); at least one article goes to
        each side.
      seed: the data seed.

    Returns:
      (train, eval) examples, each in the input order.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    article = articles_of(examples, titles)
    names = sorted(set(article.values()))
    if len(names) < 2:
        raise ValueError(f"splitting by article needs >= 2 articles, got {names}")
    held = min(len(names) - 1, max(1, round(len(names) * eval_fraction)))
    order = np.random.default_rng(seed).permutation(len(names))
    eval_titles = {names[i] for i in order[:held]}
    train = [e for e in examples if article[e.id] not in eval_titles]
    evals = [e for e in examples if article[e.id] in eval_titles]
    return train, evals
