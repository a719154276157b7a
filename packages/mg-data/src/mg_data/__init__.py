"""Megatron-compatible indexed datasets, fast preprocessing, sample datasets with cached indices, blending and a resumable sampler."""

__version__ = "0.1.0"

from mg_data.bert_dataset import BertDataset, BertDatasetConfig, NotSentenceSplitError, build_bert_datasets
from mg_data.blended import BlendedDataset, build_blending_indices
from mg_data.classification import (
    ClassificationDataset,
    ClassificationDatasetConfig,
    IndexedClassificationExamples,
    build_classification_datasets,
    tokenize_classification_jsonl,
)
from mg_data.finetune import BadExampleError, ExampleFields, IndexedExampleFields
from mg_data.gpt_dataset import GPTDataset, GPTDatasetConfig, build_gpt_datasets, make_sample, parse_blend
from mg_data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    inspect_dataset,
    optimal_dtype,
)
from mg_data.jsonl import BadLineError
from mg_data.preprocess import PreprocessConfig, PreprocessSummary, ProgressInfo, run_preprocess
from mg_data.sampler import GlobalBatchSampler
from mg_data.seq2seq import (
    Seq2SeqDataset,
    Seq2SeqDatasetConfig,
    build_seq2seq_datasets,
    tokenize_seq2seq_jsonl,
)
from mg_data.sft import (
    BadConversationError,
    ChatMLTemplate,
    ChatTemplate,
    ChatTemplateError,
    ConversationList,
    IndexedConversations,
    JinjaChatTemplate,
    encode_prompt,
    load_chat_template,
    read_conversations,
    render_conversation,
    tokenize_jsonl,
)
from mg_data.sft_dataset import SFTDataset, SFTDatasetConfig, build_sft_datasets
from mg_data.t5_dataset import T5Dataset, T5DatasetConfig, build_t5_datasets
from mg_data.tokenizers import Tokenizer, build_tokenizer, train_sentencepiece

__all__ = [
    "BadConversationError",
    "BadExampleError",
    "BadLineError",
    "BertDataset",
    "BertDatasetConfig",
    "BlendedDataset",
    "ChatMLTemplate",
    "ChatTemplate",
    "ChatTemplateError",
    "ClassificationDataset",
    "ClassificationDatasetConfig",
    "ConversationList",
    "ExampleFields",
    "GPTDataset",
    "GPTDatasetConfig",
    "GlobalBatchSampler",
    "IndexedClassificationExamples",
    "IndexedConversations",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "IndexedExampleFields",
    "JinjaChatTemplate",
    "NotSentenceSplitError",
    "PreprocessConfig",
    "PreprocessSummary",
    "ProgressInfo",
    "SFTDataset",
    "SFTDatasetConfig",
    "Seq2SeqDataset",
    "Seq2SeqDatasetConfig",
    "T5Dataset",
    "T5DatasetConfig",
    "Tokenizer",
    "build_bert_datasets",
    "build_blending_indices",
    "build_classification_datasets",
    "build_gpt_datasets",
    "build_seq2seq_datasets",
    "build_sft_datasets",
    "build_t5_datasets",
    "build_tokenizer",
    "encode_prompt",
    "inspect_dataset",
    "load_chat_template",
    "make_sample",
    "optimal_dtype",
    "parse_blend",
    "read_conversations",
    "render_conversation",
    "run_preprocess",
    "tokenize_classification_jsonl",
    "tokenize_jsonl",
    "tokenize_seq2seq_jsonl",
    "train_sentencepiece",
]
