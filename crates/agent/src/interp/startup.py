# Run silently in every Python kernel the kiln code interpreter starts. Registers two IPython
# formatters, looked up lazily by type name so nothing is imported until used:
#  - matplotlib figures also render as E2B's structured chart (line, scatter, bar, pie,
#    box-and-whisker; a figure with several axes is a "superchart");
#  - pandas DataFrames also render as column data.
def _kiln_setup():
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    ip = get_ipython()
    if ip is None:
        return

    class _KilnFormatter(BaseFormatter):
        # Matches by class name along the MRO instead of IPython's type registry: matplotlib's
        # inline backend pops every Figure printer from all formatters when it activates.
        format_type = Unicode("")
        print_method = ObjectName("_repr_kiln_")
        _return_type = (dict, list)

        def kiln_for(self, module, name, func):
            self._kiln_match = (module, name, func)

        def __call__(self, obj):
            module, name, func = self._kiln_match
            for cls in type(obj).__mro__:
                if cls.__module__ == module and cls.__name__ == name:
                    try:
                        return func(obj)
                    except Exception:
                        return None
            return None

    def _label(artist):
        label = artist.get_label() or ""
        return "" if label.startswith("_") else label

    def _num(v):
        try:
            f = float(v)
        except (TypeError, ValueError):
            return str(v)
        return int(f) if f.is_integer() else f

    def _scale(axis):
        try:
            return axis.get_scale()
        except Exception:
            return "unknown"

    def _ticks(ax, which):
        axis = ax.xaxis if which == "x" else ax.yaxis
        ticks = [_num(t) for t in axis.get_ticklocs()]
        labels = [t.get_text() for t in axis.get_ticklabels()]
        return ticks, labels

    def _is_dates(axis):
        try:
            import matplotlib.dates as mdates
            return isinstance(axis.get_major_formatter(), (mdates.DateFormatter, mdates.AutoDateFormatter, mdates.ConciseDateFormatter))
        except Exception:
            return False

    def _xy(axis, v):
        if _is_dates(axis):
            import matplotlib.dates as mdates
            return mdates.num2date(v).isoformat()
        return _num(v)

    def _axes_chart(ax):
        from matplotlib.collections import PathCollection
        from matplotlib.patches import Rectangle, Wedge

        base = {"title": ax.get_title() or None}
        wedges = [p for p in ax.patches if isinstance(p, Wedge)]
        if wedges:
            base.update(type="pie", elements=[
                {"label": w.get_label(), "angle": _num(abs(w.theta2 - w.theta1)), "radius": _num(w.r)}
                for w in wedges
            ])
            return base
        base.update(
            x_label=ax.get_xlabel() or None, y_label=ax.get_ylabel() or None,
            x_unit=None, y_unit=None,
        )
        containers = [c for c in ax.containers if type(c).__name__ == "BarContainer"]
        if containers:
            xt, xl = _ticks(ax, "x")
            names = {t: l for t, l in zip(xt, xl)}
            elements = []
            for c in containers:
                group = _label(c)
                for r in c.patches:
                    if not isinstance(r, Rectangle):
                        continue
                    x = _num(r.get_x() + r.get_width() / 2)
                    label = names.get(x)
                    if label is None:
                        label = str(x)
                    elements.append({"label": label, "group": group, "value": _num(r.get_height())})
            base.update(type="bar", elements=elements)
            return base
        xt, xl = _ticks(ax, "x")
        yt, yl = _ticks(ax, "y")
        base.update(
            x_ticks=xt, x_tick_labels=xl, x_scale="datetime" if _is_dates(ax.xaxis) else _scale(ax.xaxis),
            y_ticks=yt, y_tick_labels=yl, y_scale=_scale(ax.yaxis),
        )
        scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
        if scatters and not ax.lines:
            base.update(type="scatter", elements=[
                {"label": _label(c), "points": [[_xy(ax.xaxis, x), _num(y)] for x, y in c.get_offsets()]}
                for c in scatters
            ])
            return base
        if ax.lines:
            base.update(type="line", elements=[
                {"label": _label(l), "points": [[_xy(ax.xaxis, x), _num(y)] for x, y in zip(l.get_xdata(), l.get_ydata())]}
                for l in ax.lines
            ])
            return base
        base.update(type="unknown", elements=[])
        return base

    def _figure_chart(fig):
        axes = [a for a in fig.get_axes() if a.get_visible()]
        if not axes:
            return None
        if len(axes) == 1:
            return _axes_chart(axes[0])
        title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else None
        return {"type": "superchart", "title": title, "elements": [_axes_chart(a) for a in axes]}

    def _frame_data(df):
        import json
        return json.loads(df.to_json(orient="split", date_format="iso", default_handler=str))

    chart = _KilnFormatter(parent=ip.display_formatter)
    chart.format_type = "application/vnd.kiln.chart+json"
    chart.kiln_for("matplotlib.figure", "Figure", _figure_chart)
    data = _KilnFormatter(parent=ip.display_formatter)
    data.format_type = "application/vnd.kiln.data+json"
    data.kiln_for("pandas.core.frame", "DataFrame", _frame_data)
    ip.display_formatter.formatters[chart.format_type] = chart
    ip.display_formatter.formatters[data.format_type] = data


_kiln_setup()
del _kiln_setup
