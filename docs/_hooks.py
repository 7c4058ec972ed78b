"""MkDocs hooks: the generated benchmark results (`benchmarks/results/`, outside
docs/) become the site's `results/` pages, and the guides' links to them,
written to work on the repository's own pages, are pointed there."""
import os
import re

from mkdocs.structure.files import File

_RESULTS = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                        "benchmarks", "results")
_LINK = re.compile(r"\.\./benchmarks/results/")


def on_files(files, config):
  for name in sorted(os.listdir(_RESULTS)):
    if name.endswith((".md", ".png")):
      files.append(File.generated(config, f"results/{name}",
                                  abs_src_path=os.path.join(_RESULTS, name)))
  return files


def on_page_markdown(markdown, page, config, files):
  return _LINK.sub("results/", markdown)
