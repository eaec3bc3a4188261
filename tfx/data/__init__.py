"""Host-side data: text sources, the tokenizers (SentencePiece, Hugging Face), the token store, packed batches.

    manifest = tfx.data.prepare.prepare(config.data, "DIR")  # source -> tokenizer -> token store
    manifest, train, heldout = store.open_store("DIR")  # pread (gs:// ranged reads), checksums in a thread
    pipeline = DataPipeline.from_splits(train, heldout, eos_id=..., row_length=..., global_batch=...,
                                        seed=..., process_index=..., process_count=..., prefetch=2)
    batch = pipeline.next_batch()   # {"tokens", "segment_ids", "positions"}: int32 [local, L]
"""

from tfx.data import store
from tfx.data.pipeline import DataPipeline, tokenize_corpus
from tfx.data.sources import Corpus, load_documents
from tfx.data.hf_tokenizer import HFTokenizer
from tfx.data.tokenizer import Tokenizer, build_tokenizer, load_tokenizer, tokenizer_from_bytes

__all__ = [
    "Corpus",
    "DataPipeline",
    "HFTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "load_documents",
    "load_tokenizer",
    "store",
    "tokenize_corpus",
    "tokenizer_from_bytes",
]
