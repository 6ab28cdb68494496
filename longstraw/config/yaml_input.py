"""YAML a user supplies (experiment files, point, train and pretrain configs, `--set` values), read
with one rule more than `yaml.safe_load`: a key given twice in one mapping is refused, naming the
file, the key's path and both lines (`yaml.safe_load` keeps the last one silently).

    data = load_yaml_file("experiments/g_sweep.yaml")
    value = load_yaml_text("8", "point.yaml (--set grpo.num_generations=8)")

Invalid YAML raises `ConfigError` too: `SOURCE: not valid YAML: ...`. A mapping that merges
another (`<<: *base`) may still replace the merged keys: only the keys written in the mapping
itself count.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from longstraw.config.typed import ConfigError

MERGE_TAG = "tag:yaml.org,2002:merge"


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` whose documents may not repeat a key within one mapping (`source` names the input)."""

    source = "<yaml>"

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        self._check_unique(node, [], set())
        return self.construct_document(node)

    def _key(self, node):
        """A key node's value, as the constructor will make it (a mapping's key: its source text)."""
        if isinstance(node, ScalarNode):
            try:
                return self.construct_object(node, deep=True)
            except yaml.YAMLError:
                return (node.tag, node.value)
        return ("node", node.start_mark.line, node.start_mark.column)

    def _check_unique(self, node, path: list[str], seen_nodes: set) -> None:
        if id(node) in seen_nodes:  # an alias: checked where its anchor is
            return
        seen_nodes.add(id(node))
        if isinstance(node, MappingNode):
            lines: dict = {}
            for key_node, value_node in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self._key(key_node)
                line = key_node.start_mark.line + 1
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: the constructor refuses it with its own message
                    first = None
                    key = None
                if first is not None:
                    where = ".".join(path)
                    at = f"lines {first} and {line}" if first != line else f"both on line {line}"
                    raise ConfigError(f"{self.source}: {where + ': ' if where else ''}key {key!r} appears twice ({at})")
                if key is not None:
                    lines[key] = line
                self._check_unique(
                    value_node, path + [str(key_node.value) if isinstance(key_node, ScalarNode) else "?"], seen_nodes
                )
        elif isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                inner = path[:-1] + [f"{path[-1]}[{i}]"] if path else [f"[{i}]"]
                self._check_unique(item, inner, seen_nodes)


def load_yaml_text(text: str, source: str = "<yaml>"):
    """The YAML document in `text`; a repeated key or invalid YAML raises `ConfigError` naming `source`."""
    loader = UniqueKeyLoader(text)
    loader.source = loader.name = source  # `name`: what yaml's own messages call the input
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    finally:
        loader.dispose()


def load_yaml_file(path, source: str | None = None):
    """The YAML document in the file `path` (its name is the errors' source unless `source` is given);
    OSError for a file that cannot be read."""
    path = Path(path)
    return load_yaml_text(path.read_text(), str(path) if source is None else source)
