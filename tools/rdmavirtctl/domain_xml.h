// The little of libvirt's URIs and domain XML that rdmavirtctl reads and
// writes: the host of a URI, the RDMA NIC's <interface>, an attribute or
// the text of an element, escaping. Pure functions of their arguments, no
// XML parser: libvirt's XML is regular enough for these lookups. Safe from
// any thread.
#ifndef RDMAVIRT_TOOLS_RDMAVIRTCTL_DOMAIN_XML_H_
#define RDMAVIRT_TOOLS_RDMAVIRTCTL_DOMAIN_XML_H_

#include <string>

#include "absl/strings/string_view.h"

namespace rdmavirt::ctl {

// "qemu+ssh://host/system" -> "host"; "" without a host part.
std::string UriHost(absl::string_view uri);

// The <interface> of `domain_xml` whose alias is `alias`, "" if none.
std::string InterfaceWithAlias(absl::string_view domain_xml, absl::string_view alias);
// The value of attribute `attr` of the first element `tag` in `xml`
// ("<mac address='...'/>"): "" if absent.
std::string ElementAttribute(absl::string_view xml, absl::string_view tag, absl::string_view attr);
// The text of the first element `tag` of `xml`, unescaped; "" if none.
std::string ElementText(absl::string_view xml, absl::string_view tag);
// `s` as XML text ('&', '<' and '>' escaped).
std::string XmlEscape(absl::string_view s);

}  // namespace rdmavirt::ctl

#endif  // RDMAVIRT_TOOLS_RDMAVIRTCTL_DOMAIN_XML_H_
