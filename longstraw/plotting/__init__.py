"""Figure and formatting primitives the report and the kinds' report halves share (layer 0: only
matplotlib, pandas, numpy and `longstraw.results`).

- `formatting`: how a value reads on the page, its unit chosen from the column's name.
- `ceiling`: which memory ceiling a figure draws, and where it comes from.
- `draw`: matplotlib helpers (units, labels, failed-point markers, the ceiling line, colours,
  atomic PNG files). It imports matplotlib, so import it where a figure is drawn; the other two
  do not.
"""
