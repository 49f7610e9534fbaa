r"""Answers questions with the passages they came from, from a bundle or a training checkpoint.

    python experiments/ask.py --bundle /tmp/rag_default/bundle \
        --question "where was resa nemobu born ?" --question "which animal does resa nemobu keep ?"
    python experiments/ask.py --workdir /tmp/rag_default --question "..." --variant token

`--bundle` opens a trained run's bundle (`rag_jax.io.bundle`: seconds, no data or encoding);
`--workdir` restores the newest checkpoint and its experiment instead. Prints, per question, the
N retrieved passages with p(z|x) (prior) and p(z|x,y) (posterior: which one the answer came from),
the answer and its log-likelihood, and with RAG-Token the passage each answer token came from;
`--json` prints each answer as one JSON line instead. Compiled programs are kept in JAX's
persistent cache (`answers.enable_compilation_cache`), so later starts skip compiling.
"""

import json
import sys

from absl import app, flags, logging

from rag_jax.devices import distributed, host
from rag_jax.devices.progress import Compiling
from rag_jax.io import bundle
from rag_jax.io.answers import enable_compilation_cache

_BUNDLE = flags.DEFINE_string("bundle", None, "a bundle folder (<workdir>/bundle)")
_WORKDIR = flags.DEFINE_string("workdir", None, "a training workdir (checkpoints + config)")
_QUESTIONS = flags.DEFINE_multi_string("question", None, "a question (repeatable)")
_VARIANT = flags.DEFINE_enum("variant", None, ["sequence", "token"], "default: the run's")
_BEAMS = flags.DEFINE_integer("num_beams", None, "default: the run's (1 = greedy)")
_N_DOCS = flags.DEFINE_integer("n_docs", None, "passages per question; default: the run's")
_JSON = flags.DEFINE_bool("json", False, "one JSON line per answer")
flags.mark_flag_as_required("question")
flags.mark_flags_as_mutual_exclusive(["bundle", "workdir"], required=True)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    enable_compilation_cache()
    if _BUNDLE.value:
        model = bundle.load(_BUNDLE.value, fast_compile=True)  # a few answers, once
    else:
        # Imported here: the trainer's 0.5 s of imports are no part of a bundle's start-up.
        from rag_jax.training import loop

        print(f"restoring {_WORKDIR.value}: its experiment and newest checkpoint", file=sys.stderr)
        exp, state, step = loop.restore(_WORKDIR.value)
        params = distributed.replicated_to_host(state.params)
        model = bundle.Bundle.from_experiment(exp, params, step=step)
    ask = lambda: model.answer(  # noqa: E731
        _QUESTIONS.value, variant=_VARIANT.value, num_beams=_BEAMS.value, n_docs=_N_DOCS.value
    )
    if model.traces:  # compiled already (a restored run's)
        answers = ask()
    else:
        with Compiling(2, "answering programs (the question encoder, the decoding)"):
            answers = ask()
    for answer in answers:
        if _JSON.value:
            print(json.dumps(answer.to_dict()))
            continue
        print(f"\nQ: {answer.question}" + ("  (truncated)" if answer.truncated else ""))
        print("   prior  posterior")
        for n, p in enumerate(answer.passages):
            print(f"{n:>2} {p.prior:6.3f} {p.posterior:9.3f}  [{p.id}] {p.title}: {p.text[:120]}")
        print(f"A: {answer.answer}   (log p = {answer.log_likelihood:.3f})")
        for token in answer.tokens or ():
            best = max(range(len(token.posteriors)), key=token.posteriors.__getitem__)
            print(f"   {token.token!r:>16} <- passage {best} ({token.posteriors[best]:.3f})")


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    app.run(main)
