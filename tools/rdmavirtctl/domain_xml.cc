#include "tools/rdmavirtctl/domain_xml.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace rdmavirt::ctl {

std::string UriHost(absl::string_view uri) {
  size_t p = uri.find("://");
  if (p == absl::string_view::npos) return "";
  absl::string_view rest = uri.substr(p + 3);
  rest = rest.substr(0, rest.find_first_of("/?"));
  if (size_t at = rest.find('@'); at != absl::string_view::npos) rest = rest.substr(at + 1);
  if (!rest.empty() && rest[0] != '[') rest = rest.substr(0, rest.find(':'));
  return std::string(rest);
}

std::string InterfaceWithAlias(absl::string_view xml, absl::string_view alias) {
  for (size_t from = 0;;) {
    const size_t start = xml.find("<interface ", from);
    if (start == absl::string_view::npos) return "";
    const size_t end = xml.find("</interface>", start);
    if (end == absl::string_view::npos) return "";
    absl::string_view block = xml.substr(start, end + 12 - start);
    if (absl::StrContains(block, absl::StrCat("<alias name='", alias, "'/>")) ||
        absl::StrContains(block, absl::StrCat("<alias name=\"", alias, "\"/>")))
      return std::string(block);
    from = end;
  }
}

std::string ElementAttribute(absl::string_view xml, absl::string_view tag, absl::string_view attr) {
  const size_t t = xml.find(absl::StrCat("<", tag, " "));
  if (t == absl::string_view::npos) return "";
  const size_t close = xml.find('>', t);
  absl::string_view el = xml.substr(t, close == absl::string_view::npos ? xml.npos : close - t);
  for (char q : {'\'', '"'}) {
    const std::string key = absl::StrCat(" ", attr, "=", std::string(1, q));
    const size_t a = el.find(key);
    if (a == absl::string_view::npos) continue;
    const size_t v = a + key.size();
    const size_t e = el.find(q, v);
    if (e != absl::string_view::npos) return std::string(el.substr(v, e - v));
  }
  return "";
}

std::string XmlEscape(absl::string_view s) {
  return absl::StrReplaceAll(s, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}});
}

std::string ElementText(absl::string_view xml, absl::string_view tag) {
  const std::string open = absl::StrCat("<", tag, ">"), close = absl::StrCat("</", tag, ">");
  const size_t a = xml.find(open);
  if (a == absl::string_view::npos) return "";
  const size_t b = xml.find(close, a + open.size());
  if (b == absl::string_view::npos) return "";
  return absl::StrReplaceAll(
      xml.substr(a + open.size(), b - a - open.size()),
      {{"&lt;", "<"}, {"&gt;", ">"}, {"&quot;", "\""}, {"&apos;", "'"}, {"&amp;", "&"}});
}

}  // namespace rdmavirt::ctl
