// murmur console (issue #38): replaces the cluster section with each one the server sends.
(function () {
  var region = document.getElementById("cluster");
  if (!region || !window.EventSource) return;
  var source = new EventSource(region.getAttribute("data-live"));
  source.addEventListener("cluster", function (event) { region.innerHTML = event.data; });
})();
