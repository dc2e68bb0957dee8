"""CIDEr-D in process: clipped n-gram tf-idf cosine with a Gaussian length penalty, fast for SCST rewards.

Equal to pycocoevalcap's `Cider` (which implements CIDEr-D) on the same tokenised text; document
frequencies come from a fixed reference corpus (for SCST: the training references).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

NGram = tuple[str, ...]


def ngram_counts(words: Sequence[str], n: int) -> Counter[NGram]:
    """Counts of every 1..n-gram of a tokenised sentence."""
    counts: Counter[NGram] = Counter()
    for k in range(1, n + 1):
        counts.update(tuple(words[i : i + k]) for i in range(len(words) - k + 1))
    return counts


def _length(words: Sequence[str]) -> int:
    # pycocoevalcap's length for the penalty counts bigrams (its order index 1), i.e. words − 1.
    return max(len(words) - 1, 0)


@dataclass
class _ImageRefs:
    """One image's references as dense tf-idf rows over the n-grams they contain."""

    columns: dict[NGram, int]
    weights: np.ndarray  # (R, G) tf-idf of each reference over the image's n-grams
    order: np.ndarray  # (G,) n-gram order − 1 of each column
    norms: np.ndarray  # (R, n) per-order L2 norm of each reference
    lengths: np.ndarray  # (R,)


class CiderD:
    """CIDEr-D (n-grams 1..n, σ = 6, clipped, ×10) against a reference corpus fixed at construction."""

    def __init__(
        self,
        references: Mapping[Hashable, Sequence[str]],
        n: int = 4,
        sigma: float = 6.0,
        document_frequencies: Mapping[Hashable, Sequence[str]] | None = None,
    ):
        """references: image key → its reference captions, each a space-separated tokenised string.
        `document_frequencies`: another corpus of the same form to count document frequencies and images
        in (pyciderevalcap's `df=` cached corpus, as self-critical.pytorch's `coco-train-idxs`); default:
        `references`."""
        if not references:
            raise ValueError("CIDEr-D needs at least one image with references")
        self.n, self.sigma = n, sigma
        self._refs_text = {key: [ref.split() for ref in refs] for key, refs in references.items()}
        for key, refs in self._refs_text.items():
            if not refs:
                raise ValueError(f"image {key!r} has no reference captions; drop it or add references")
        corpus = self._refs_text
        if document_frequencies is not None:
            corpus = {key: [ref.split() for ref in refs] for key, refs in document_frequencies.items()}
            if not corpus:
                raise ValueError("CIDEr-D's document-frequency corpus is empty")
        document_frequency: Counter[NGram] = Counter()
        for refs in corpus.values():
            document_frequency.update({g for ref in refs for g in ngram_counts(ref, n)})
        self._df = document_frequency
        self._log_images = float(np.log(float(len(corpus))))
        self._cache: dict[Hashable, _ImageRefs] = {}

    def idf(self, gram: NGram) -> float:
        """log(#images) − log(max(1, df)); unseen n-grams get the full log(#images)."""
        return self._log_images - float(np.log(max(1.0, float(self._df.get(gram, 0)))))

    def _image(self, key: Hashable) -> _ImageRefs:
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if key not in self._refs_text:
            raise KeyError(f"image {key!r} has no references in the CIDEr-D corpus")
        refs = self._refs_text[key]
        counts = [ngram_counts(ref, self.n) for ref in refs]
        columns: dict[NGram, int] = {}
        for c in counts:
            for g in c:
                columns.setdefault(g, len(columns))
        idf = np.array([self.idf(g) for g in columns])
        order = np.array([len(g) - 1 for g in columns], dtype=np.int64)
        weights = np.zeros((len(refs), len(columns)))
        for r, c in enumerate(counts):
            for g, tf in c.items():
                weights[r, columns[g]] = tf
        weights *= idf
        norms = np.sqrt(self._per_order(weights**2, order))
        lengths = np.array([_length(ref) for ref in refs], dtype=np.float64)
        entry = _ImageRefs(columns, weights, order, norms, lengths)
        self._cache[key] = entry
        return entry

    def _per_order(self, values: np.ndarray, order: np.ndarray) -> np.ndarray:
        """Sum the columns of `values` (R, G) within each n-gram order → (R, n)."""
        out = np.zeros((values.shape[0], self.n))
        np.add.at(out.T, order, values.T)
        return out

    def score_one(self, key: Hashable, caption: str) -> float:
        """CIDEr-D of one tokenised caption against image `key`'s references."""
        refs = self._image(key)
        words = caption.split()
        counts = ngram_counts(words, self.n)
        vector = np.zeros(len(refs.columns))
        norms = np.zeros(self.n)
        for g, tf in counts.items():
            weight = tf * self.idf(g)
            norms[len(g) - 1] += weight * weight
            column = refs.columns.get(g)
            if column is not None:
                vector[column] = weight
        norms = np.sqrt(norms)
        # Clipping: a candidate's n-gram weight counts at most the reference's.
        products = self._per_order(np.minimum(vector, refs.weights) * refs.weights, refs.order)
        denominator = norms[None, :] * refs.norms
        similarity = np.divide(products, denominator, out=products.copy(), where=denominator != 0)
        delta = _length(words) - refs.lengths
        similarity *= np.exp(-(delta**2) / (2 * self.sigma**2))[:, None]
        return float(similarity.mean(axis=1).sum() / len(refs.lengths) * 10.0)

    def scores(self, pairs: Iterable[tuple[Hashable, str]]) -> np.ndarray:
        """CIDEr-D of each (image key, tokenised caption) pair."""
        return np.array([self.score_one(key, caption) for key, caption in pairs], dtype=np.float64)

    def corpus_score(self, captions: Mapping[Hashable, str]) -> tuple[float, np.ndarray]:
        """Mean and per-image CIDEr-D of one caption per image, like pycocoevalcap's `compute_score`."""
        per_image = self.scores(captions.items())
        return float(per_image.mean()), per_image
