"""Figure and formatting primitives the report and the kinds' report halves share (layer 0: only
matplotlib, pandas, numpy and `longstraw.results`).

- `formatting`: how a value reads on the page, its unit chosen from the column's name (sizes in
  GiB with GB beside them, losses to 6 significant digits), and where a size axis turns log.
- `ceiling`: which memory ceiling a figure draws, where it comes from, and why it is that one.
- `styles`: each mode's colour (ours here; a peer's added when it is registered, `longstraw.peers`).
- `draw`: matplotlib helpers (memory axes in GiB and GB, labels, failed-point markers, the ceiling
  line, bar widths, legends beside the axes, colours, atomic PNG files). It imports matplotlib, so
  import it where a figure is drawn; the others do not.
"""
