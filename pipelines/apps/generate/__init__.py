"""`xmodal generate`'s applications on a trained DALL-E: `sample` (prompt → images), `rerank` (by the
transformer's likelihood, or a judge: `rerank_captioner`, `rerank_matching`), `evaluate` (prompt accuracy)."""
