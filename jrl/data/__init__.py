"""Data: JSONL records -> sectioned token documents -> packed rows -> resumable batches.

See docs/training.md ("Data") for the formats and the row layout.
"""

from jrl.data.encode import encode_record
from jrl.data.packing import ROW_FIELDS, assemble_rows, doc_pieces, plan_rows
from jrl.data.pipeline import DataChangedError, DataSource, RowDataset, build_dataset, fixed_batches, load_documents
from jrl.data.sampler import EpochSampler
from jrl.data.store import TokenStore, build_store, open_store, write_store
from jrl.data.text import Tokenizer, load_tokenizer

__all__ = [
    "DataChangedError", "DataSource", "EpochSampler", "ROW_FIELDS", "RowDataset", "TokenStore", "Tokenizer",
    "assemble_rows", "build_dataset", "build_store", "doc_pieces", "encode_record", "fixed_batches",
    "load_documents", "load_tokenizer", "open_store", "plan_rows", "write_store",
]
