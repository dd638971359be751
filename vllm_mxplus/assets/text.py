"""Clean English text from the ``gensim`` wheel: Wikipedia articles and Lee news stories.

Output format (both files): one paragraph per line, articles separated by one blank line,
UTF-8, ending in a newline. :func:`read_articles` reads it back.

Wikipedia: gensim's test data holds a shortened dump of the first English Wikipedia pages
(``Anarchism``, ``Autism``, ...). ``extract_pages`` yields (title, wikitext, id);
``filter_wiki`` strips links, templates, references and tables but leaves emphasis quotes,
headings, lists, gallery/image captions and some punctuation debris from removed templates.
We keep prose paragraphs only (see :func:`clean_wiki_article`).

News: ``lee_background.cor`` is 300 Australian news stories (Lee et al. 2005), one per line,
already plain text; we only normalise whitespace.
"""

from __future__ import annotations

import bz2
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

from vllm_mxplus.assets import (
    AssetError,
    atomic_write_text,
    package_file,
    require_module,
    resolve_cache_dir,
)

logger = logging.getLogger(__name__)

GENSIM_DIST = "gensim"
WIKI_FILE = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
NEWS_FILE = "gensim/test/test_data/lee_background.cor"
#: Bump when the cleaning rules change so that cached text files are rebuilt.
TEXT_FORMAT_VERSION = 1

#: A paragraph needs this many words: shorter lines are captions, headings or list debris.
MIN_WORDS = 15
#: Sections after which a Wikipedia article holds only references, links and lists.
_STOP_SECTIONS = re.compile(
    r"^=+\s*(see also|references|notes|external links|further reading|bibliography|sources|"
    r"citations|footnotes|notes and references|works cited|literature)\s*=+$",
    re.IGNORECASE,
)
#: Any of these in a cleaned line means markup survived (gallery captions keep "File:x|y",
#: table cells keep "|", some tags keep "<"), so the line is dropped rather than repaired.
_MARKUP = (
    "|",
    "[[",
    "]]",
    "{{",
    "}}",
    "<",
    ">",
    "==",
    "File:",
    "Image:",
    "Category:",
    "thumb",
    "alt=",
    "http",
    "://",
    "&nbsp",
)
_LINE_START_JUNK = tuple("*#:;!{}|=")  # lists, definitions, tables, headings
_ENDS_SENTENCE = (".", "!", "?", '"', "'", "\u201d", ")")


def clean_wiki_article(filtered: str) -> list[str]:
    """Prose paragraphs of one article, given gensim ``filter_wiki`` output.

    Why each rule: ``filter_wiki`` keeps ``'''bold'''``/``''italic''`` quotes (removed);
    templates such as pronunciations vanish but leave ``(; born ...)`` or ``( , ...)``
    (repaired); headings, lists, tables and preformatted code (a leading space in wikitext)
    are not running text (dropped); short lines and lines without final punctuation are
    captions or fragments (dropped); a line with any markup remnant is dropped whole.
    """
    paragraphs: list[str] = []
    for raw in filtered.split("\n"):
        stripped = raw.strip()
        if _STOP_SECTIONS.match(stripped):
            break
        if not stripped or raw[0] in " \t" or stripped.startswith(_LINE_START_JUNK):
            continue
        line = _repair(stripped)
        if any(marker in line for marker in _MARKUP):
            continue
        if len(line.split()) < MIN_WORDS or not line.endswith(_ENDS_SENTENCE):
            continue
        paragraphs.append(line)
    return paragraphs


def _repair(line: str) -> str:
    """Undo the cosmetic debris ``filter_wiki`` leaves in otherwise good prose."""
    line = line.replace("'''", "").replace("''", "")
    line = re.sub(r"\(\s*(?:[,;:]\s*)*\)", "", line)  # "()" / "(; )" from removed templates
    line = re.sub(r"\((?:\s*[,;:])*\s*", "(", line)  # "(; 4 April 1932" -> "(4 April 1932"
    line = re.sub(r"\s+([,;:.!?)])", r"\1", line)  # "formula , n" -> "formula, n"
    line = re.sub(r"([,;:])(?=[,;:.])", "", line)  # ",," / ",." left by removed words
    return re.sub(r"\s+", " ", line).strip()


def iter_wiki_articles(dump: Path) -> Iterator[tuple[str, list[str]]]:
    """Yield ``(title, paragraphs)`` for each main-namespace, non-redirect page in ``dump``."""
    require_module("gensim")
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    with bz2.open(dump, "rb") as stream:
        for title, wikitext, _pageid in extract_pages(stream, filter_namespaces=("0",)):
            if wikitext.lstrip()[:9].upper() == "#REDIRECT":
                continue
            paragraphs = clean_wiki_article(filter_wiki(wikitext))
            if paragraphs:
                yield title, paragraphs


def _text_paths(cache_dir: str | os.PathLike[str] | None, name: str) -> tuple[Path, Path]:
    root = resolve_cache_dir(cache_dir) / "text"
    return root / f"{name}.txt", root / f"{name}.json"


def _up_to_date(txt: Path, meta: Path, source: Path) -> bool:
    """The text exists and its metadata names the same cleaner version and source file."""
    if not (txt.is_file() and meta.is_file()):
        return False
    try:
        info = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        info.get("format_version") == TEXT_FORMAT_VERSION
        and info.get("source_bytes") == source.stat().st_size
        and info.get("bytes") == txt.stat().st_size
    )


def _write(
    txt: Path, meta: Path, articles: list[list[str]], source: Path, extra: dict[str, object]
) -> None:
    """Write the text, then its metadata (last: it is the completion marker)."""
    body = "\n\n".join("\n".join(paragraphs) for paragraphs in articles) + "\n"
    atomic_write_text(txt, body)
    info = {
        "format_version": TEXT_FORMAT_VERSION,
        "source": str(source),
        "source_bytes": source.stat().st_size,
        "articles": len(articles),
        "paragraphs": sum(len(p) for p in articles),
        "words": len(body.split()),
        "bytes": txt.stat().st_size,
        **extra,
    }
    atomic_write_text(meta, json.dumps(info, indent=2) + "\n")


def prepare_wikipedia_text(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Clean gensim's shortened English Wikipedia dump into ``<cache>/text/wikipedia.txt``.

    Idempotent (skipped when the file and its ``wikipedia.json`` metadata are current).
    Returns the path of the text file; see the module docstring for its format.
    """
    source = package_file(GENSIM_DIST, WIKI_FILE)
    txt, meta = _text_paths(cache_dir, "wikipedia")
    if _up_to_date(txt, meta, source):
        return txt
    titles: list[str] = []
    articles: list[list[str]] = []
    for title, paragraphs in iter_wiki_articles(source):
        titles.append(title)
        articles.append(paragraphs)
    if not articles:
        raise AssetError(f"no article survived cleaning in {source}")
    _write(txt, meta, articles, source, {"titles": titles})
    logger.info("Wikipedia text: %d articles -> %s", len(articles), txt)
    return txt


def prepare_news_text(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Copy gensim's ``lee_background.cor`` news stories into ``<cache>/text/news.txt``.

    Each story (one line in the source) becomes one paragraph-article; whitespace is
    normalised and empty lines dropped. Idempotent like :func:`prepare_wikipedia_text`.
    """
    source = package_file(GENSIM_DIST, NEWS_FILE)
    txt, meta = _text_paths(cache_dir, "news")
    if _up_to_date(txt, meta, source):
        return txt
    stories = [" ".join(line.split()) for line in source.read_text(encoding="utf-8").splitlines()]
    articles = [[story] for story in stories if story]
    if not articles:
        raise AssetError(f"{source} is empty")
    _write(txt, meta, articles, source, {})
    logger.info("News text: %d stories -> %s", len(articles), txt)
    return txt


def read_articles(path: str | os.PathLike[str]) -> list[str]:
    """The articles of a prepared text file, each with its paragraphs joined by newlines."""
    text = Path(path).read_text(encoding="utf-8")
    return [block.strip() for block in text.split("\n\n") if block.strip()]


def count_tokens(path: str | os.PathLike[str], tokenizer_dir: str | os.PathLike[str]) -> int:
    """Number of tokens of the whole file under ``tokenizer_dir``'s ``tokenizer.json``.

    The file is tokenised article by article, without special tokens: that is what a
    perplexity evaluation consumes. We call the ``tokenizers`` library directly (it ships with
    transformers) because it is ~5x faster here and does not warn about articles longer than
    the model's context.
    """
    require_module("tokenizers")
    from tokenizers import Tokenizer

    tokenizer_json = Path(tokenizer_dir) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise AssetError(f"no tokenizer.json in {tokenizer_dir}")
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    encoded = tokenizer.encode_batch(read_articles(path), add_special_tokens=False)
    return sum(len(e.ids) for e in encoded)
