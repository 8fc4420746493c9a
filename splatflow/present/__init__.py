"""What a person looks at or takes away from a run: the exported files (``export``), the report page
(``report``, its HTML in ``templates/``), the interactive viewer (``viewer``) and the live view of a
training run (``live_view``), the page comparing two runs (``compare_html``) and the report's bundled
3D viewer script (``webbundle``).
"""
