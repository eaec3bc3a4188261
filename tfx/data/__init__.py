"""Host-side data: text sources, the SentencePiece tokenizer, packing into batches.

    corpus = load_documents("stdlib")
    tokenizer = build_tokenizer("", corpus, vocab_size=8000, workdir=workdir)
    pipeline = DataPipeline.from_config(config.data, tokenizer, corpus, row_length=...,
                                        global_batch=..., seed=..., process_index=...,
                                        process_count=...)
    batch = pipeline.next_batch()   # {"tokens", "segment_ids", "positions"}: int32 [local, L]
"""

from tfx.data.pipeline import DataPipeline, tokenize_corpus
from tfx.data.sources import Corpus, load_documents
from tfx.data.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "Corpus",
    "DataPipeline",
    "Tokenizer",
    "build_tokenizer",
    "load_documents",
    "tokenize_corpus",
]
