"""The browser pages' files (HTML, CSS, JS), served by :mod:`localinfer.serve.http.pages`."""
