"""The reviewer's pages: self-contained HTML files (inline SVG, CSS and JavaScript) that a
reviewer opens from disk or as a CI artifact.

* ``spec_page``: ``sfa-rd2h review OLD NEW --html OUT`` - a protocol change drawn on the
  machine diagrams, with the rules, predicates, seeded bugs and tests of what it touches;
* ``explain_page``: ``sfa-rd2h explain SOURCE --html OUT`` - a checker counterexample or a
  folder of real traces as a step-through view;
* ``page``: what both build on (machine SVGs with addressable edges, the word diff, the
  template filling); the HTML, CSS and JavaScript are the package's template files;
* ``commands``: the two sub-commands.
"""
