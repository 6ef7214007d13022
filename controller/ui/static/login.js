// The login page: says so when the last attempt failed (/ui/login?failed=1).
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  if (new URLSearchParams(location.search).has("failed")) document.getElementById("failed").hidden = false;
});
