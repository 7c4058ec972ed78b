"""MkDocs hooks: the generated benchmark results (`benchmarks/results/`, outside
docs/) become the site's `results/` pages, and the guides' links to them,
written to work on the repository's own pages, are pointed there; the home
page's `START` marker becomes the README's opening (the set-up commands to
the end of the quick start), so the two never differ."""
import os
import re


_RESULTS = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                        "benchmarks", "results")
_LINK = re.compile(r"\.\./benchmarks/results/")
_README = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")
START = "<!-- the README's set-up commands and quick start -->"
# where the README's opening ends: the paragraph after the quick start's
# 8-device line
_START_ENDS = "`shard(state, stage, mesh=...)`"


def readme_start(readme: str) -> str:
  """The README's text from its set-up commands (under the title) to the
  end of its quick start; its links to docs/ made the site's."""
  body = readme.split("\n", 1)[1]
  if _START_ENDS not in body:
    raise ValueError(f"README.md has no paragraph starting {_START_ENDS!r}: "
                     "docs/_hooks.py's home page cannot find its quick start")
  return re.sub(r"\]\(docs/", "](", body[:body.index(_START_ENDS)]).strip()


def on_files(files, config):
  from mkdocs.structure.files import File   # (the rest reads without mkdocs)
  for name in sorted(os.listdir(_RESULTS)):
    if name.endswith((".md", ".png")):
      files.append(File.generated(config, f"results/{name}",
                                  abs_src_path=os.path.join(_RESULTS, name)))
  return files


def on_page_markdown(markdown, page, config, files):
  if START in markdown:
    with open(_README) as f:
      markdown = markdown.replace(START, readme_start(f.read()))
  return _LINK.sub("results/", markdown)
